"""Whether the supervisor may drain: does its user have Slurm operator rights?

Draining and resuming nodes, and acting on other users' jobs, need operator
rights in Slurm: root, the ``SlurmUser``, or ``AdminLevel=Administrator`` in
the accounting database (slurmctld lets only these "super users" update a
node; an Operator level is not enough). A researcher's own supervisor
(``systemd/user``) has none of these: it runs in exclude mode, where a blamed
node is excluded from the job and ticketed for the admins
(:class:`supervisor.core.intents.DrainTicket`), never drained.

``slurm_rights`` (a supervisor setting) is ``auto`` (detect, below),
``operator`` or ``user`` (say so; e.g. ``user`` for an operator who wants
tickets rather than drains). Detection reads and changes nothing:

1. effective uid 0: operator;
2. the user is ``SlurmUser`` in ``scontrol show config``: operator;
3. with an accounting database (``AccountingStorageType`` slurmdbd),
   ``sacctmgr -nP show user <name> format=AdminLevel`` says Administrator:
   operator; anything else, no accounting database, or ``sacctmgr``
   failing: user.

:func:`judge` is pure; :func:`detect` asks Slurm.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass

from supervisor.errors import SlurmError
from supervisor.slurm.interface import SlurmQueries

SETTINGS = ("auto", "operator", "user")
_DRAINING_LEVELS = {"administrator"}


@dataclass(frozen=True)
class Rights:
    """``operator``: may drain and resume nodes; ``why``: how that was decided, in words."""

    operator: bool
    why: str

    @property
    def mode(self) -> str:
        """``drain`` or ``exclude``: what the supervisor does with a blamed node."""
        return "drain" if self.operator else "exclude"

    def describe(self) -> str:
        """One sentence for the log and ``resurgo status``."""
        if self.operator:
            return f"Slurm operator rights ({self.why}): a blamed node is drained"
        return (
            f"no Slurm operator rights ({self.why}): a blamed node is excluded from the job "
            "and from your later jobs, and a drain ticket asks the admins to drain it"
        )


def config_value(config_text: str, key: str) -> str | None:
    """A setting's value in ``scontrol show config`` output (``Key = value``)."""
    for line in config_text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip() or None
    return None


def slurm_user(config_text: str) -> str | None:
    """``SlurmUser``'s name in ``scontrol show config`` output (``SlurmUser = slurm(64030)``)."""
    value = config_value(config_text, "SlurmUser")
    return None if value is None else value.split("(")[0].strip() or None


def has_accounting_database(config_text: str) -> bool:
    """Whether slurmctld keeps accounting in slurmdbd (where AdminLevel lives)."""
    return (config_value(config_text, "AccountingStorageType") or "").endswith("/slurmdbd")


def admin_level(sacctmgr_text: str) -> str:
    """The AdminLevel ``sacctmgr -nP show user NAME format=AdminLevel`` printed ('' if none)."""
    lines = [line.strip() for line in sacctmgr_text.splitlines() if line.strip()]
    return lines[0].lower() if lines else ""


def judge(
    setting: str, uid: int, user: str, slurm_user_name: str | None, level: str | None
) -> Rights:
    """The rights ``setting`` gives, or (``auto``) the facts show; ``level`` None: unknown."""
    if setting == "operator":
        return Rights(True, "slurm_rights = operator")
    if setting == "user":
        return Rights(False, "slurm_rights = user")
    if uid == 0:
        return Rights(True, "running as root")
    if slurm_user_name is not None and user == slurm_user_name:
        return Rights(True, f"{user} is the SlurmUser")
    if level in _DRAINING_LEVELS:
        return Rights(True, f"{user} has AdminLevel {level.capitalize()}")
    not_slurm_user = f"not the SlurmUser ({slurm_user_name or 'unknown'})"
    if level is None:
        return Rights(False, f"{user} is not root, {not_slurm_user}, and no accounting database")
    return Rights(
        False,
        f"{user} is not root, {not_slurm_user}, AdminLevel {level.capitalize() or 'None'} "
        "(draining needs Administrator)",
    )


async def detect(slurm: SlurmQueries, setting: str) -> Rights:
    """The supervisor's rights.

    Raises :class:`~supervisor.errors.SlurmError` when slurmctld could not be
    asked: try again later.
    """
    if setting != "auto" or os.geteuid() == 0:
        return judge(setting, os.geteuid(), getpass.getuser(), None, None)
    user = getpass.getuser()
    config = await slurm.show_config()
    name = slurm_user(config)
    if name == user or not has_accounting_database(config):
        return judge(setting, os.geteuid(), user, name, None)
    try:
        level: str | None = admin_level(await slurm.admin_level(user))
    except SlurmError:
        level = None  # no accounting database to ask: AdminLevel cannot be set there
    return judge(setting, os.geteuid(), user, name, level)
