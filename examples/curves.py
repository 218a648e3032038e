"""Progress and learning curves for the example recipes: one JSONL row per step, a PNG beside it.

`CurveLog` prints a line per step with the elapsed time and an ETA, appends the step's numbers
to `<out>.jsonl` as they arrive (so a killed run keeps its curve) and draws `<out>.png` at the
end. It uses only the standard library and matplotlib, so the recipes stay plain scripts over
the public `tinker` SDK.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


class CurveLog:
    """Numbers per step to `<stem>.jsonl` (truncated at start), a progress line per step to stdout."""

    def __init__(self, stem: str, total_steps: int, title: str, label: str = "") -> None:
        self.jsonl_path = stem + ".jsonl"
        self.png_path = stem + ".png"
        self.total_steps = total_steps
        self.title = title
        self.label = label
        self.rows: list[dict] = []
        self.started = time.monotonic()
        os.makedirs(os.path.dirname(self.jsonl_path) or ".", exist_ok=True)
        open(self.jsonl_path, "w").close()

    def record(self, step: int, **numbers) -> dict:
        elapsed = time.monotonic() - self.started
        row = {"step": step, "elapsed_s": round(elapsed, 2), **numbers}
        self.rows.append(row)
        with open(self.jsonl_path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        # The ETA assumes the remaining steps cost what the finished ones did on average.
        eta = elapsed / step * (self.total_steps - step) if step else 0.0
        shown = "  ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())
        prefix = f"[{self.label}] " if self.label else ""
        # One write per line (newline included): runs in threads of one script never splice lines.
        print(
            f"{prefix}step {step}/{self.total_steps}  {shown}  elapsed {elapsed:.0f}s  eta {eta:.0f}s\n",
            end="",
            flush=True,
        )
        return row

    def plot(self, keys: list[str], smooth: int = 1, ylabel: Optional[str] = None) -> str:
        """One line per key over steps (a trailing mean over `smooth` steps); returns the PNG path."""
        plt.figure(figsize=(6.5, 3.8))
        for key in keys:
            points = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None]
            if not points:
                continue
            steps, values = zip(*points)
            plt.plot(
                steps, _trailing_mean(list(values), smooth), label=key if smooth <= 1 else f"{key} (mean of {smooth})"
            )
        plt.xlabel("step")
        plt.ylabel(ylabel or ", ".join(keys))
        plt.title(self.title)
        plt.legend()
        plt.grid(alpha=0.3)
        plt.tight_layout()
        plt.savefig(self.png_path, dpi=120)
        plt.close()
        return self.png_path


def _trailing_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _fmt(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
