"""`csmserve speak`'s progress bar on stderr: seconds of audio against an estimate from the text's length."""
from __future__ import annotations

import sys
import time

CHARS_PER_SECOND = 14.0  # rough speaking rate: the progress bar's estimate of the total


class Progress:
    """A rich progress bar on stderr, in seconds of audio against an estimate from the text length."""

    def __init__(self, text: str, enabled: bool) -> None:
        self.start = time.perf_counter()
        self.load_s = 0.0
        self.first: float | None = None
        self.enabled, self.total = enabled, max(1.0, len(text) / CHARS_PER_SECOND)
        self.bar = None

    def _show(self) -> None:
        """Start drawing (once the model is loaded or audio arrives: an early error stays one line)."""
        if self.bar is not None or not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress as Bar, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bar = Bar(SpinnerColumn(), TextColumn("[bold]speaking"), BarColumn(),
                       TextColumn("{task.completed:.1f} / ~{task.total:.1f} s of audio"),
                       TextColumn("{task.fields[rt]}"), TimeElapsedColumn(),
                       console=Console(file=sys.stderr), transient=False)
        self.task = self.bar.add_task("speak", total=self.total, rt="")
        self.bar.start()

    def loaded(self) -> None:
        """The model is loaded: time to first audio and the real-time factor count from here."""
        now = time.perf_counter()
        self.load_s, self.start = now - self.start, now
        self._show()

    def update(self, seconds: float) -> None:
        now = time.perf_counter()
        if self.first is None and seconds > 0:
            self.first = now
        self._show()
        if self.bar is not None:
            wall = now - self.start
            rt = f"{seconds / wall:.2f}x real time" if wall > 0 and seconds > 0 else ""
            self.total = max(self.total, seconds)
            self.bar.update(self.task, completed=seconds, total=self.total, rt=rt)

    def finish(self, seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=seconds, total=max(seconds, 0.01))
            self.bar.stop()
