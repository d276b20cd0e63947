"""Log of one shard: follows the tail, says when the stream dropped and when it came back."""

from __future__ import annotations

import asyncio
import time

from rich.text import Text
from textual.widgets import RichLog

MAX_LINES = 2000                  # capped buffer: memory stays flat over hours


class ShardLog(RichLog):
    def __init__(self, **kw):
        super().__init__(max_lines=MAX_LINES, wrap=False, markup=False, auto_scroll=True, **kw)
        self.shard: int | None = None
        self._follow_task: asyncio.Task | None = None
        self.status = "idle"

    def follow(self, source, shard: int | None) -> None:
        """Follow `shard`'s log (None: stop)."""
        if shard == self.shard and self._follow_task and not self._follow_task.done():
            return
        if self._follow_task:
            self._follow_task.cancel()
        self.shard = shard
        self.clear()
        if shard is None:
            return
        self.write(Text(f"— log of shard {shard} —", "bold"))
        self._follow_task = asyncio.create_task(self._follow(source, shard))

    async def _follow(self, source, shard: int) -> None:
        dropped = False
        while True:
            try:
                async for line in source.follow_log(shard):
                    if dropped:
                        self.write(Text(f"— stream back at {time.strftime('%H:%M:%S')} —", "green"))
                        dropped = False
                    self.status = "following"
                    self.write(line)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not dropped:
                    self.write(Text(f"— stream dropped at {time.strftime('%H:%M:%S')}: {e} — retrying", "red"))
                dropped = True
                self.status = "dropped"
            await asyncio.sleep(2)

    def on_unmount(self) -> None:
        if self._follow_task:
            self._follow_task.cancel()
