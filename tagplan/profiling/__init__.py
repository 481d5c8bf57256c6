"""Profile this machine: time ops and collectives and write them as a `tagplan-traces/1` bundle.

`machine.profile` is what `tagplan profile` runs; `device` describes and fingerprints the
device, `ops`/`grids`/`timing` time the op grid, `collectives` the collectives among local
ranks, `iterations` real training iterations.
"""

from tagplan.profiling.machine import OpCase, command_line, default_world, profile

__all__ = ["OpCase", "command_line", "default_world", "profile"]
