"""A fake Slurm command runner: records each command line and answers as Slurm would.

Stands for the subprocess runner under :class:`supervisor.slurm.client.SlurmClient`
(its ``runner`` argument) in the unit tests of submission and registration:
``sbatch`` answers a job id (or refuses), every other command succeeds silently.
The live tier runs the real Slurm commands on the local cluster instead
(tests/integration/test_submit_live.py, tests/integration/test_slurm_client.py).
"""

from __future__ import annotations


class Recorder:
    """A Slurm CLI runner that records argv and answers like Slurm would."""

    def __init__(self, sbatch_answer: str = "4711\n") -> None:
        self.calls: list[list[str]] = []
        self.sbatch_answer = sbatch_answer

    async def __call__(self, argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        self.calls.append(argv)
        if argv[0] == "sbatch":
            return (0, self.sbatch_answer, "") if self.sbatch_answer else (1, "", "bad partition")
        return 0, "", ""
