import json, urllib.request, sys
sys.path.insert(0, "/tmp/wt-tok/tests")
def tok(s):
    r = urllib.request.Request("http://127.0.0.1:18777/tokenize", data=json.dumps({"content": s, "add_special": False, "parse_special": True}).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r))["tokens"]
from models.tokenizer import Tokenizer
from test_tokenizer import STRINGS
from test_tokenizer_gemma3 import GEMMA_STRINGS, _prompt_texts
ours = Tokenizer.from_path("/root/.cache/xlaserve/models/gemma-3-270m-q4_k_m.gguf")
S = list(dict.fromkeys(_prompt_texts() + GEMMA_STRINGS + STRINGS))
bad = [(s, ours.encode(s, False), tok(s)) for s in S if ours.encode(s, False) != tok(s)]
print(len(S), "strings;", len(bad), "differ from llama.cpp")
for s, a, b in bad[:12]: print(repr(s[:50]), ours.convert_ids_to_tokens(a)[:8], ours.convert_ids_to_tokens(b)[:8])
print("40 spaces llama.cpp:", [len(ours.id_to_token(i)) for i in tok(" " * 40)])
