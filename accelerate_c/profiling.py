"""`Accelerator.profile()`: torch.profiler around a block of the user's code, with the settings
of a ProfileKwargs handler (accelerate's or ours), and a Chrome trace per process when the
handler names a directory. A mixin of Accelerator (accelerator.py holds what prepares and steps)."""
from __future__ import annotations

import contextlib
import os

from .plugins import kind_of
from .utils.dataclasses import ProfileKwargs

# accelerate's file name for the trace of process <suffix> (users' tools look for it)
TRACE_NAME = "profile_{suffix}.json"


class ProfileFacade:
    """Reads self.profile_handler (set from kwargs_handlers by Accelerator.__init__),
    self.process_index and self.wait_for_everyone."""

    profile_handler = None

    @contextlib.contextmanager
    def profile(self, profile_handler=None):
        """Profiles the block; yields the running torch.profiler.profile (call its step() per
        iteration under a schedule). `profile_handler` overrides the Accelerator's handler for
        this block. With output_trace_dir set, every process writes its trace there and the
        processes then wait for each other (so the directory is complete when any leaves)."""
        if profile_handler is not None and kind_of(profile_handler, (ProfileKwargs,)) is None:
            raise TypeError("Accelerator.profile(profile_handler=...): expected a ProfileKwargs (accelerate_c's or "
                            f"accelerate's), got {type(profile_handler).__module__}.{type(profile_handler).__name__}")
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(handler.output_trace_dir,
                                                  TRACE_NAME.format(suffix=self.process_index)))
        self.wait_for_everyone()
