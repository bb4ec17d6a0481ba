"""int8 KV against fp32 KV end to end, as a result file: the measurement of tests/test_int8_kv_e2e.py
(embedded model, fp32 S-part, 64 varied prompts x 64 greedy tokens; the fp32-KV run gives the
reference tokens, the int8- and bf16-KV runs are teacher-forced along them), written down with its
numbers: top-1 agreement over the decoded positions and the mean |delta logprob| of the reference
token. Writes bench/kernel/results/int8_agreement_<label>.json.

    python3 bench/kernel/int8_agreement.py [--label smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

from tests.test_bf16_spart import FORMS, TOPICS  # noqa: E402
from tests.test_int8_kv_e2e import NEW, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="smollm2-135m")
    args = ap.parse_args()
    texts = [FORMS[i % 4].format(TOPICS[i % 16]) + f" (#{i})" for i in range(64)]
    ref, fp32 = run("fp32", texts, None)
    keys = [(rid, pos) for rid, toks in ref.items() for pos in range(1, len(toks))]
    result = {"label": args.label, "host": platform.node(), "model": "smollm2-135m", "dtype": "float32",
              "prompts": 64, "new_tokens": NEW, "positions": len(keys), "kv": {}}
    for kv_dtype in ("int8", "bf16"):
        _, q = run(kv_dtype, texts, ref)
        agree = sum(q.top[k] == ref[k[0]][k[1]] for k in keys)
        dlogp = np.array([abs(q.logprob[k] - fp32.logprob[k]) for k in keys])
        result["kv"][kv_dtype] = {"agree": agree, "top1_agreement": round(agree / len(keys), 5),
                                  "mean_abs_delta_logprob": round(float(dlogp.mean()), 5),
                                  "max_abs_delta_logprob": round(float(dlogp.max()), 4)}
        print(f"{kv_dtype}: top-1 agreement {agree}/{len(keys)}, mean |delta logprob| {dlogp.mean():.4f}", flush=True)
    path = os.path.join(HERE, "results", f"int8_agreement_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
