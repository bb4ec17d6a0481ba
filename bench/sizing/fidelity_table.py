"""Write fastdecode/sizing/fidelity_table.py from the committed fidelity results, so that `plan`
says how far it has been off (fastdecode/sizing/fidelity.py). Rerun after adding results:

    python3 bench/sizing/fidelity_table.py
"""
from __future__ import annotations

import os
import pprint
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from fastdecode.sizing.fidelity import derive  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "sizing", "results")
TABLE = os.path.join(REPO, "fastdecode", "sizing", "fidelity_table.py")


def render(table: dict) -> str:
    return ('"""Plan fidelity by (S-worker kind, bound), derived from bench/sizing/results by\n'
            'bench/sizing/fidelity_table.py (fastdecode/sizing/fidelity.py reads it). Generated: rerun the script\n'
            'rather than edit; tests/test_plan_fidelity.py checks it against the results."""\n\n'
            f"FIDELITY = {pprint.pformat(table, width=110, sort_dicts=True)}\n")


if __name__ == "__main__":
    with open(TABLE, "w") as f:
        f.write(render(derive(RESULTS)))
    print(f"wrote {os.path.relpath(TABLE, REPO)}")
