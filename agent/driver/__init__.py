"""The in-job driver: the batch script's main program (``python -m agent.driver``).

``resurgo submit`` writes a batch script that ``exec``s this. It

1. asks the supervisor how to launch (``POST /v1/driver``, phase ``start``):
   on the current allocation, resuming from the checkpoint the supervisor
   chose when the job was requeued;
2. runs one node agent per node with ``srun`` (explicit counts and node list
   from the current allocation: inherited counts are wrong after a resize),
   each agent launching the user's command (usually torchrun);
3. while the step runs, asks every few seconds whether the supervisor moved
   on (phase ``running``): a step with a task on a dead node never ends by
   itself, so when a relaunch of a later attempt (or a stop) is ordered, the
   driver ends the step (SIGTERM, then SIGKILL);
4. when a step fails, asks again (phase ``ended``) and, told so, starts a
   new step on the nodes the supervisor names, with ``RESURGO_RESUME_FROM``
   (and ``RESURGO_SKIP_SAMPLES``, the data to leave out after a rollback past
   a loss anomaly) set through the agent, and confirms the relaunch (phase
   ``relaunched``);
5. exits 0 when a step succeeds or the supervisor says the run completed (a
   rank that died in its teardown after the last step), and exits
   :data:`~agent.driver.loop.DO_NOT_REQUEUE_EXIT` (93)
   with the supervisor's reason when told to stop (a crash loop, a user
   error, no valid checkpoint, an operator's cancel): Slurm records the job
   FAILED with exit code 93, which tells wrappers and dependency chains not
   to start it again;
6. before the time limit (Slurm's ``USR1``, requested by ``resurgo submit``,
   or its own timer from the job's time left and the measured save time)
   runs the planned stop of :mod:`agent.timelimit`: a notice to the agents
   (final checkpoint, then a graceful stop) and to the supervisor, which
   requeues the job at its size before Slurm ends it; a supervisor that does
   not do so in time is replaced by ``scontrol requeue`` of the job itself.

A supervisor that does not answer is retried with jittered backoff
(tenacity) for ``--supervisor-wait-s``; the running step never depends on it.
If the supervisor stays unreachable at start, the job launches anyway and the
in-rank library resumes from the newest valid checkpoint by itself. After a
failure with no supervisor to ask, the driver ends the job with the step's
exit status rather than guessing where to relaunch.

The driver runs ``srun``, ``scontrol`` and ``squeue`` for its own job only; the
supervisor's Slurm adapter is the one place that administers Slurm.

The package, by responsibility: :mod:`~agent.driver.settings` (its flags),
:mod:`~agent.driver.argv` (the ``srun`` command lines, pure),
:mod:`~agent.driver.slurm` (the Slurm commands it runs for its own job),
:mod:`~agent.driver.loop` (:class:`~agent.driver.loop.Driver`: ask, launch,
watch, relaunch), :mod:`~agent.driver.sparechecks` (the idle spares' health
checks beside a step) and :mod:`~agent.driver.plannedstop` (the time limit).
Importing this package imports none of them.
"""
