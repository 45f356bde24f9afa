"""The job config's schema: `job` (`JobConfig` and the job-level sections), `trainer` (the `trainer:`
section), `base` (what every section is, and `ConfigPath`). `JobConfig` and `ConfigPath` are exported
from `d9d.trainer`."""
