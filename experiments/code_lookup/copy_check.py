"""Greedy check of a code_lookup SFT checkpoint on 20 held-out words: does it call the tool, copy the word into the
call, and copy the tool's code into its answer (given the right tool result)? HF `generate`, one thread.

    python experiments/code_lookup/copy_check.py <checkpoint> [notools] [--len MIN MAX]

`--len` sets the word lengths (default: the env's defaults).
"""

import itertools
import json
import sys

import primerl_code_lookup as c
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
args = sys.argv[1:]
lengths = (c.CodeLookupConfig().min_len, c.CodeLookupConfig().max_len)
if "--len" in args:
    at = args.index("--len")
    lengths, args = (int(args[at + 1]), int(args[at + 2])), args[:at] + args[at + 3 :]
d = args[0]
tok = AutoTokenizer.from_pretrained(d)
m = AutoModelForCausalLM.from_pretrained(d)
tools = None if "notools" in args else c.demonstrations(1, 0)[0]["tools"]
called = copied = answered = 0
n = 20
for w in itertools.islice(c.words(0, "eval", *lengths), n):
    msgs = [{"role": "system", "content": c.SYSTEM_PROMPT}, {"role": "user", "content": c.prompt(w)}]
    ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, return_dict=False)
    out = m.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    t1 = tok.decode(out[0][len(ids) :], skip_special_tokens=False)
    called += "<tool_call>" in t1
    copied += f'"word": "{w}"' in t1
    code = c.code_of(w, "primerl")
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"word": w})}}
    msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c", "content": code}]  # fmt: skip
    ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, return_dict=False)
    out = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    answered += tok.decode(out[0][len(ids) :], skip_special_tokens=True).strip() == code
print(f"called {called}/{n} word copied {copied}/{n} code copied {answered}/{n}; last call: {t1[40:70]!r}")
