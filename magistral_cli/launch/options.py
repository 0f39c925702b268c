"""What the user asked of a launch beyond the recipe (``magistral train``'s options).

Its own module because the launcher, the pre-flight and the torchrun supervision all read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LaunchOptions:
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    #: Start nothing, write nothing (the checks run, and what this machine lacks only warns).
    dry_run: bool = False
    #: With ``dry_run``: write the run directory all the same, for a job started elsewhere (``--slurm``).
    write_run_dir: bool = False
    #: Write into a checkpoint directory that another run owns, on purpose (``--share-checkpoints``).
    share_checkpoints: bool = False
    #: Resume a checkpoint under a changed data set-up, the data order started again (``--restart-data``).
    restart_data: bool = False

    @property
    def writes(self) -> bool:
        return not self.dry_run or self.write_run_dir
