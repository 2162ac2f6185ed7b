"""Sequence: one stream of tokens being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

import enum
import itertools

from engine.sampling_params import SamplingParams

# The value a sampled token holds in `token_ids` from the step that samples it (dispatched)
# until the host reads it back (one step later when steps overlap).
PENDING = -1
# A draft booked into a step whose token the draft model has yet to draw (between the
# scheduler's booking and engine/draft_model.py's drafting, within one engine step).
TO_DRAW = -2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, block_size: int,
                 request_id: str | None = None, cache_salt: str | None = None,
                 session: str | None = None):
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # Tokens whose K/V are in the cache: from the prefix cache or computed by earlier steps.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_table: list[int] = []
        # How often the block table lost trailing pages (rejected drafts' pages freed): an
        # input batch that copied it at fewer cuts rewrites its copy, stale even at the same
        # length (the target's and a draft model's batches each keep one).
        self.table_cuts = 0
        self.finish_reason: str | None = None
        self.num_pending = 0  # trailing PENDING tokens: sampled on the device, not yet read
        self.cache_salt = cache_salt  # prefix-cache namespace: only equal salts share blocks
        self.session = session  # a stored conversation that keeps its blocks once it finishes

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens the host knows (pending ones excluded)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including pending ones: the index the next sampled token gets."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        """Token ids of logical block i."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending(self) -> int:
        """A step that samples this sequence was dispatched: its token takes a PENDING place
        (the next step can already compute it from the device). Returns its position."""
        self.token_ids.append(PENDING)
        self.num_pending += 1
        return len(self.token_ids) - 1

    def resolve(self, position: int, token_id: int) -> None:
        """The host read the token sampled for `position` (the oldest pending one)."""
        if self.token_ids[position] != PENDING:
            raise RuntimeError(f"sequence {self.seq_id}: position {position} is not pending")
        self.token_ids[position] = token_id
        self.num_pending -= 1

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens from `num_tokens` on (pending ones past a stop)."""
        dropped = self.token_ids[num_tokens:]
        del self.token_ids[num_tokens:]
        self.num_pending -= sum(1 for t in dropped if t == PENDING)
