"""Progress on rank 0: a tqdm bar on a terminal, a log line every few seconds otherwise."""
from __future__ import annotations

import sys
import time

LOG_EVERY_S = 10.0


class Progress:
    def __init__(self, total: int | None, enabled: bool = True, desc: str = "requests"):
        self.total, self.desc = total, desc
        self.done, self.tokens = 0, 0
        self.start = self.last_log = time.perf_counter()
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False

    def update(self, n: int, output_tokens: int) -> None:
        self.done += n
        self.tokens = output_tokens
        now = time.perf_counter()
        rate = output_tokens / max(now - self.start, 1e-9)
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        elif self.enabled and now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            total = f"/{self.total}" if self.total is not None else ""
            print(f"fastdecode: {self.done}{total} {self.desc} done, {output_tokens} output tokens, "
                  f"{rate:.1f} tok/s, {now - self.start:.0f} s", file=sys.stderr, flush=True)
