"""LLMEngine: the synchronous engine for one model (scripts, tests, the engine thread).

`add_request` tokenizes and admits; `step` schedules and dispatches one batch and returns
the outputs that changed, as deltas (engine/outputs.py); `generate` loops until done and
returns whole outputs.

With `async_scheduling` (the default) steps overlap: `step` dispatches step n+1 first and
only then waits for step n's tokens and hands out its outputs, so the device never waits
for the host's bookkeeping (the scheduler books progress at dispatch; see
engine/scheduler.py). Outputs are the same either way. On the 2-core CPU the host's work
shares the cores with the step, and overlap still measured faster at 1, 8 and 64 streams
(docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import numbers
import random
import time
from collections.abc import Sequence as Seq

from engine.batch import InputBatch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.draft_costs import StepCosts
from engine.draft_model import DraftModel
from engine.grammar import Grammars, advance, allowed_drafts
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput, TextState, TokenLogprob, accumulate
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import RequestRejected, Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import drop_drafts
from models.tokenizer import Tokenizer

_GOLDEN = 0x9E3779B97F4A7C15


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[TextState]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def head_rows(entries) -> list[int]:
    """Each scheduled entry's first head row (an entry has one, plus one per draft)."""
    return list(itertools.accumulate((e.num_rows for e in entries), initial=0))[:len(entries)]


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 tokenizer: Tokenizer | None = None, detokenize: bool = True,
                 draft: DraftModel | None = None):
        self.config = config
        self.detokenize = detokenize
        self.tokenizer = tokenizer or Tokenizer.for_model(config.model)
        self.runner = runner or ModelRunner(config)
        # The runner may size the KV pool itself (a share of device memory, engine/device.py).
        sized = getattr(getattr(self.runner, "config", None), "num_blocks", None)
        if config.num_blocks is None and sized is not None:
            config = self.config = dataclasses.replace(config, num_blocks=sized)
        self.block_manager = BlockManager(config.total_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.tokenizer.eos_token_ids)
        # What steps of each token bucket take (speculative decoding's cost model): the
        # runner's timings at warmup, then the steps that ran (`_read`).
        self.scheduler.drafting.step_costs = StepCosts(getattr(self.runner, "step_seconds", None))
        # A draft model's runner beside the target's (engine/draft_model.py), over its pages.
        spec = config.speculative
        if draft is None and spec is not None and spec.method == "draft_model":
            draft = DraftModel.for_target(config, self.tokenizer)
        self.draft = draft
        self.input_batch = InputBatch(config, self.tokenizer.eos_token_ids)
        self.async_scheduling = config.async_scheduling
        # (SchedulerOutput, pending step, token bucket, seconds its drafts took) dispatched,
        # not yet read
        self._in_flight = None
        # when the last step's result came, while busy (timed only when drafting is on)
        self._last_done: float | None = None
        self.wait_s = 0.0  # time spent waiting for the device's results (benchmarks)
        model_cfg = getattr(self.runner, "model_config", None)  # fake runners in tests have none
        self.vocab_size: int | None = (model_cfg.vocab_size if model_cfg is not None
                                       else getattr(self.tokenizer, "vocab_size", None))
        self.grammars = Grammars(self.tokenizer, self.vocab_size or self.tokenizer.vocab_size)
        self._matchers: dict[int, object] = {}  # seq_id -> its grammar's matcher
        self.requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, int]] = {}
        self._seeds: dict[int, int] = {}
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.num_aborted = 0  # requests aborted before they finished (client gone)
        self.num_steps = 0  # steps dispatched (engine.profiling counts a trace's steps)

    def warmup(self) -> None:
        """Compile (or load) every executable the steps will run: the target's, and a draft
        model's (whose drafting round starts the cost model)."""
        self.runner.warmup()
        if self.draft is not None:
            drafting = self.scheduler.drafting
            lookup = self.config.speculative.looks_up
            round_s, drafting.step_costs.draft_steps = self.draft.warmup(catch_up=lookup)
            drafting.step_costs.record_round(round_s)
            drafting.draft_behind = self.draft.behind if lookup else None

    def release(self) -> None:
        """Free the device memory of the runners now (ModelRunner.release)."""
        self.runner.release()
        if self.draft is not None:
            self.draft.runner.release()

    # ---- requests ------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; ids given directly are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        for i in ids:
            if not isinstance(i, numbers.Integral) or isinstance(i, bool) or i < 0 or (
                    self.vocab_size is not None and i >= self.vocab_size):
                raise RequestRejected(f"prompt token id {i!r} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        return [int(i) for i in ids]

    def check_logit_bias(self, params: SamplingParams) -> None:
        """A request's logit_bias ids against the vocabulary, as `encode` checks prompt ids
        (SamplingParams checked the rest)."""
        if self.vocab_size is not None and params.logit_bias:
            bad = [i for i, _ in params.logit_bias if i >= self.vocab_size]
            if bad:
                raise SamplingParamsError("logit_bias", f"logit_bias: token id {bad[0]} is "
                                          f"outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    session: str | None = None) -> str:
        """Queue a request; `cache_salt` keeps its prefix-cache blocks apart from requests
        with another salt (or none); once it finishes, `session` keeps its blocks cached
        (BlockManager.keep) until `release_session`."""
        params = params or SamplingParams()
        self.check_logit_bias(params)
        ids = self.encode(prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens)  # raises RequestRejected
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        base = params.seed if params.seed is not None else self._rng.getrandbits(63)
        matchers = [self.grammars.matcher(params.structured_outputs)  # raises GrammarError
                    for _ in range(params.n)] if params.structured_outputs else []
        req = Request(request_id, ids, params, [], [])
        for i in range(params.n):
            seq = Sequence(ids, params, self.config.block_size, request_id, cache_salt, session)
            if matchers:
                self._matchers[seq.seq_id] = matchers[i]
            self._seeds[seq.seq_id] = (base + i * _GOLDEN) % (1 << 63)
            self._by_seq[seq.seq_id] = (req, i)
            req.seqs.append(seq)
            req.texts.append(TextState(self.tokenizer if self.detokenize else None, ids,
                                       params.stop,
                                       params.skip_special_tokens))
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return request_id

    def release_session(self, session: str) -> None:
        """The stored conversation is gone: its blocks become ordinary cached blocks."""
        self.block_manager.release(session)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.num_aborted += 1
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        return self._output(req, list(range(len(req.seqs))))

    def has_unfinished(self) -> bool:
        # A step still in flight only matters while its sequences are unfinished, and those
        # are the scheduler's (the next `step` reads it either way).
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch the next step; return the outputs of the step read back now
        (the one dispatched before this one when steps overlap, else this one).

        While any request follows a grammar, steps do not overlap: its next mask needs the
        token just sampled (the mask is still computed while the device runs the body). Nor
        do steps that may draft (speculative decoding): drafts continue from the last token.
        Where such a step follows an overlapped one, the latter's outputs are returned at once,
        before the next step is built: a prompt's first token does not wait for drafts drawn
        after it (a draft model's first round writes its K/V for the whole prompt)."""
        speculate = self.scheduler.may_speculate()
        overlap = self.async_scheduling and not self._matchers and not speculate
        if not overlap and self._in_flight is not None:
            previous, self._in_flight = self._in_flight, None
            if outputs := self._read(*previous):
                return outputs
        out = self.scheduler.schedule(speculate)
        drafting_s = self._draw_drafts(out) if self.draft is not None else 0.0
        if self._matchers and self.config.speculative is not None:
            for entry in out.scheduled:  # a grammar's drafts: only as far as it allows them
                if entry.drafts and entry.seq.seq_id in self._matchers:
                    allowed = allowed_drafts(self._matchers[entry.seq.seq_id], entry.drafts)
                    drop_drafts(entry, len(entry.drafts) - allowed, self.block_manager)
        launched = None
        if out.scheduled:
            for entry in out.scheduled:
                if entry.seq.seq_id in self._by_seq:
                    req = self._by_seq[entry.seq.seq_id][0]
                    req.num_cached_tokens = max(req.num_cached_tokens,
                                                entry.seq.num_cached_tokens)
            batch = self.input_batch.build(out, self._seeds)
            rows = [(row, self._matchers[e.seq.seq_id], list(e.drafts))
                    for row, e in zip(head_rows(out.scheduled), out.scheduled, strict=True)
                    if e.samples and e.seq.seq_id in self._matchers] if self._matchers else []
            if rows:
                batch.token_mask = functools.partial(self.grammars.fill_mask, rows,
                                                     batch.bucket[1])
            launched = out, self.runner.submit(batch), batch.bucket[0], drafting_s
            self.num_steps += 1
        if not overlap:
            return [] if launched is None else self._read(*launched)
        previous, self._in_flight = self._in_flight, launched
        return [] if previous is None else self._read(*previous)

    def _draw_drafts(self, out: SchedulerOutput) -> float:
        """The draft model draws the drafts `out` booked; its rounds of a token or two a
        sequence feed the cost model. Returns the seconds the whole draw took, rounds that
        write a prompt's draft K/V included: none of it is the target's step."""
        start = time.perf_counter()
        self.draft.draw(out, self._seeds,
                        (self.grammars, self._matchers) if self._matchers else None,
                        self.block_manager)
        for seconds in self.draft.round_seconds:
            self.scheduler.drafting.step_costs.record_round(seconds)
        return time.perf_counter() - start

    def _read(self, out: SchedulerOutput, pending, bucket: int,
              drafting_s: float = 0.0) -> list[RequestOutput]:
        """Wait for a dispatched step, record its tokens and build the outputs that changed.

        With drafting on, its cost model learns what a step of `bucket` tokens costs as the time
        from the previous step's result to this one's, while the engine is busy: the device's
        time and the host's share that did not overlap it, so a drafting step (which waits
        for the token before it) pays for the overlap it gives up, and a step is timed at the
        context its sequences have. The draft model's time before the step (`drafting_s`) is
        not the step's: its rounds are learnt apart (StepCosts.draft_round)."""
        waited = time.perf_counter()
        result = pending.result()
        done = time.perf_counter()
        self.wait_s += done - waited
        if self._last_done is not None:
            self.scheduler.drafting.step_costs.record(bucket, done - self._last_done - drafting_s)
        ended = {e.seq.seq_id for e in out.scheduled if e.seq.is_finished}  # while it ran
        first_rows = head_rows(out.scheduled)
        ids = result.token_ids.tolist()
        sampled = [ids[r:r + e.num_rows] if e.samples else None
                   for r, e in zip(first_rows, out.scheduled, strict=True)]
        self.scheduler.postprocess(out, sampled)
        touched: dict[str, list[int]] = {}
        for row, entry in zip(first_rows, out.scheduled, strict=True):
            if (not entry.samples or entry.seq.seq_id in ended
                    or entry.seq.seq_id not in self._by_seq):
                continue
            req, index = self._by_seq[entry.seq.seq_id]
            # the step's tokens: one, or the kept drafts and the one sampled after them (token j
            # was drawn by the entry's head row j)
            for j, token in enumerate(entry.new_tokens):
                if self._add_token(req, index, entry, token, result, row + j,
                                   last=j == len(entry.new_tokens) - 1):
                    break
            touched.setdefault(req.request_id, []).append(index)
        outputs = [self._output(self.requests[rid], idx) for rid, idx in touched.items()]
        if self.config.speculative is not None:  # (the cost model serves drafting alone)
            # Idle until a request comes: the next step's time starts from its own dispatch.
            self._last_done = done if self.has_unfinished() else None
        return outputs

    def _add_token(self, req: Request, index: int, entry, token: int, result, row: int,
                   last: bool) -> bool:
        """Hand one sampled token to its sequence's text and grammar; True when it ends the
        sequence (the scheduler's stops end it at the step's last token)."""
        text = req.texts[index]
        logprob = None
        if req.params.logprobs is not None:
            n = req.params.logprobs
            top = zip(result.top_ids[row][:n], result.top_logprobs[row][:n], strict=True)
            logprob = TokenLogprob(token, float(result.logprobs[row]),
                                   [(int(t), float(lp)) for t, lp in top])
        stopped = text.add(token, logprob)
        matcher = self._matchers.get(entry.seq.seq_id)
        complete = not stopped and matcher is not None and advance(matcher, token)
        if (last and entry.seq.is_finished) or complete:  # (complete: only the end may follow)
            stopped |= text.finish() or complete
        if stopped:
            self.scheduler.finish(entry.seq, "stop")
            entry.seq.finish_reason = "stop"
        return stopped

    def _output(self, req: Request, changed: list[int]) -> RequestOutput:
        """The request's delta: what each changed sequence has new since its last output."""
        outs, changed = [], set(changed)
        for i, (seq, text) in enumerate(zip(req.seqs, req.texts, strict=True)):
            new_ids, new_logprobs = text.take() if i in changed else ([], [])
            outs.append(CompletionOutput(
                index=i, text=text.delta(seq.is_finished) if i in changed else "",
                token_ids=new_ids,
                finish_reason=seq.finish_reason if seq.is_finished else None,
                logprobs=new_logprobs if req.params.logprobs is not None else None))
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
            for seq in req.seqs:
                self._by_seq.pop(seq.seq_id, None)
                self._seeds.pop(seq.seq_id, None)
                self._matchers.pop(seq.seq_id, None)
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, finished,
                             num_cached_tokens=req.num_cached_tokens)

    # ---- scripts ------------------------------------------------------------------------

    def generate(self, prompts: Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; whole outputs in the order of `prompts`."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        whole: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                whole[out.request_id] = accumulate(whole.get(out.request_id), out)
        return [whole[i] for i in ids]
