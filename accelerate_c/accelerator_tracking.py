"""The Accelerator's experiment tracking (accelerate's `log_with`, `init_trackers`, `log`,
`get_tracker`, `trackers`, `end_training`): a mixin of Accelerator, kept apart so
accelerator.py holds what prepares and steps. The trackers themselves are in tracking.py and
tracking_adapters.py.

As in accelerate, trackers live on the main process only: init_trackers and log do nothing on
the others, where `trackers` stays empty and get_tracker returns a blank GeneralTracker."""
from __future__ import annotations

from .tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, check_tracker_kwargs, filter_trackers, is_tracker_instance


class TrackerFacade:
    """Reads self.state and self.project_configuration, which Accelerator.__init__ sets before
    calling setup_trackers."""

    def setup_trackers(self, log_with):
        """Checks `log_with` now (an unknown name, a missing package or a missing logging
        directory is an error at construction) and keeps it for init_trackers."""
        self.log_with = filter_trackers(log_with, self.project_configuration.logging_dir)
        self.trackers = []

    def _runs_trackers(self) -> bool:
        return self.state.is_main_process or not self.state.use_distributed

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None):
        """Starts every tracker of log_with for `project_name` (the run or project name each
        package knows), stores `config` as the run's hyperparameters, and passes
        `init_kwargs[name]` to the tracker called name. Main process only."""
        if not self._runs_trackers():
            return
        init_kwargs = check_tracker_kwargs("init_trackers(init_kwargs)", init_kwargs, self.log_with)
        logging_dir = self.project_configuration.logging_dir
        for entry in self.log_with:
            if is_tracker_instance(entry):  # the user's own, already built
                self.trackers.append(entry)
                continue
            name = str(getattr(entry, "value", entry))
            cls = LOGGER_TYPE_TO_CLASS[name]
            kwargs = init_kwargs.get(name, {})
            if cls.requires_logging_directory:
                self.trackers.append(cls(project_name, logging_dir, **kwargs))
            else:
                self.trackers.append(cls(project_name, **kwargs))
        for tracker in self.trackers:
            tracker.start()
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (unwrap: the package's own run object). On a process
        without trackers (not the main one, or before init_trackers), a blank GeneralTracker
        whose methods do nothing, as accelerate returns."""
        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"get_tracker({name!r}): no such tracker; this Accelerator's trackers are "
                         f"{[t.name for t in self.trackers]}")

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        """Logs `values` to every tracker at `step`, `log_kwargs[name]` passed to the tracker
        called name. Main process only."""
        if not self._runs_trackers():
            return
        log_kwargs = check_tracker_kwargs("log(log_kwargs)", log_kwargs, self.trackers)
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def finish_trackers(self):
        """Closes every tracker and forgets them (accelerate_c's: end_training without
        destroying the process group, for a loop that goes on, as the Trainer's)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()

    def end_training(self):
        """Closes the trackers, then destroys the process group, as accelerate does."""
        self.finish_trackers()
        self.state.destroy_process_group()
