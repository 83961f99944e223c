"""Teacher-forced header copy: for every work line, the probability that the model copies the statement right
after writing its first header char, on each path (all lines canonical / swapped / operator first)."""
import dataclasses, json, sys
import torch
from dms_runtime.loading import load_model
from tasks.chain import parse_problem
from tasks.cot import COMMUTATIVE, derived_line
from tasks.jsonl import read_jsonl
from tasks.prompt import format_prompt

model_dir, problems_file, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, tok = load_model(model_dir)
model.eval()
paths = {"canonical": (False, False), "swapped": (True, False), "opfirst": (False, True)}
stats = {name: [] for name in paths}
for row in read_jsonl(problems_file)[:limit]:
    problem = parse_problem(row["prompt"])
    values = problem.values
    for name, (swap, opfirst) in paths.items():
        lines, probe = [], []  # probe: (char offset of the header's 2nd char, header length) per work line
        text = format_prompt(problem.text)
        for a in problem.assignments:
            if not a.is_input:
                b = dataclasses.replace(a, y=a.z, z=a.y) if swap and a.op in COMMUTATIVE and a.y != a.z else a
                line = derived_line(b, values, opfirst)
                valid = {a.op} if opfirst else ({a.y, a.z} if a.op in COMMUTATIVE else {a.y})
                probe.append((len(text) + 1 + 2, (swap and b is not a) or not swap, valid))  # +1: <bos>
                text += line + "\n"
            text += f"{a.var}:{values[a.var]:02d}\n"
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text) + 1
        ops = [tok.convert_tokens_to_ids(c) for c in "+-*"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        for start, counted, valid in probe:
            if not counted:
                continue  # a line that has only one order: not a swapped-path probe
            # the header's three chars after "r=": the first one given its class (an operator or a variable),
            # then the other two given everything before
            first = logp[start - 1]
            ops_mass = torch.logsumexp(first[ops], 0)
            cls = ops_mass if opfirst else torch.log1p(-ops_mass.exp().clamp(max=1 - 1e-6))
            right = torch.logsumexp(first[[tok.convert_tokens_to_ids(c) for c in valid]], 0)
            p = (right - cls).item() + sum(logp[i - 1, ids[i]].item() for i in (start + 1, start + 2))
            stats[name].append(p)
out = {}
for name, lps in stats.items():
    probs = torch.tensor(lps).exp()
    out[name] = {"lines": len(lps), "mean_error": round(1 - probs.mean().item(), 4),
                 "lines_error>0.5": round((probs < 0.5).float().mean().item(), 4),
                 "lines_error>0.1": round((probs < 0.9).float().mean().item(), 4)}
print(json.dumps({"model": model_dir, **out}, indent=1))
