"""Scratch what-if behind docs/foundation.md (session 21): the forecast with each operator read made surer (its right token's logit raised by 0, 2, 4, 8). Run from the repository root: .venv/bin/python docs/results/forecast/operator_read_whatif.py runs/dev100_of_140.jsonl"""
import sys, random, string, json
import torch
sys.path.insert(0, "scripts")
import vote_forecast as vf
from dms_runtime.loading import SHIPPED_MODEL, load_model
from tasks.chain import parse_problem
from tasks.jsonl import read_jsonl
model, tok = load_model(str(SHIPPED_MODEL))
letters = tok.convert_tokens_to_ids(list(string.ascii_lowercase)); minus = tok.convert_tokens_to_ids("-")
rows = read_jsonl(sys.argv[1])
for boost in (0.0, 2.0, 4.0, 8.0):
    rng = random.Random(0); g = v = t = 0.0
    for r in rows:
        p = parse_problem(r["prompt"])
        lines = []
        for reads in vf.needed_reads(model, tok, p):
            d = {}
            for key, read in reads.items():
                op = read.operator.clone(); op[read.want[1]] += boost  # a surer operator read
                d[key] = vf.HeaderRead(**{**read.__dict__, "operator": torch.log_softmax(op, -1)})
            lines.append(d)
        odds = [vf.line_odds(l, letters, minus, 1.0) for l in lines]
        right, wrong = vf.answer_odds(odds)
        g += all(o.greedy_right for o in odds); t += right; v += vf.vote_wins(right, wrong, 16, 300, rng)
    n = len(rows)
    print(json.dumps({"operator_logit_boost": boost, "greedy": round(g / n, 3), "thread": round(t / n, 3), "vote": round(v / n, 3), "gain": round((v - g) / n, 3)}))
