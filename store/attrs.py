"""The Optuna attribute keys lora-sweep reads and writes: the one table of them.

Optuna keeps free-form attributes on a study and on each trial (``user_attrs``, shown by
optuna-dashboard and copied into results.db's ``trials.user_attrs``; ``system_attrs``, internal).
Every module names them through these constants; only ``sweep.ledger`` writes them.

============================  ========  ======  ==============================================================
constant (key)                on        kind    meaning
============================  ========  ======  ==============================================================
``DEFAULT`` (default)         trial     user    True on the community-default trial and on its retries
``BASELINE`` (baseline)       trial     user    True on the trial of the config's own hyperparameters (the
                                                study's ``baseline``) and on its retries
``RETRY_OF`` (retry_of)       trial     user    number of the failed trial whose parameters this one retries;
                                                the retried trial no longer counts against the budget
``ADAPTER_PATH``              trial     user    absolute path of a COMPLETE trial's adapter (report and export
(adapter_path)                                  find it from any host)
``REASON`` (reason)           trial     user    why the trial was pruned or failed
``TOKENS`` (tokens)           trial     user    target tokens the trial trained, set when it is told
``PLANNED_TOKENS``            trial     user    target tokens the trial trains if it runs all its steps, set
(planned_tokens)                                when it is asked (other workers count the token budget by it)
``HEARTBEAT``                 trial     system  wall-clock seconds of the trial's last heartbeat (shared studies)
(sweep:heartbeat)
``WORKER`` (sweep:worker)     trial     system  index of the worker training the trial (shared studies)
``SEARCH_SPACE``              study     user    fingerprint of the search space; a resume with another one is
(search_space)                                  refused
``CLOCK`` (sweep:clock)       study     user    the shared study's wall-time clock ``{start, banked}``
``DIRECTORY``                 study     user    the study directory that runs the study without workers over a
(sweep:directory)                               storage outside it; a run from another directory is refused
============================  ========  ======  ==============================================================
"""

from __future__ import annotations

__all__ = ["DEFAULT", "BASELINE", "RETRY_OF", "ADAPTER_PATH", "REASON", "TOKENS", "PLANNED_TOKENS", "HEARTBEAT",
           "WORKER", "SEARCH_SPACE", "CLOCK", "DIRECTORY", "TRIAL_USER_ATTRS", "TRIAL_SYSTEM_ATTRS", "STUDY_USER_ATTRS"]

DEFAULT = "default"
BASELINE = "baseline"
RETRY_OF = "retry_of"
ADAPTER_PATH = "adapter_path"
REASON = "reason"
TOKENS = "tokens"
PLANNED_TOKENS = "planned_tokens"
HEARTBEAT = "sweep:heartbeat"
WORKER = "sweep:worker"
SEARCH_SPACE = "search_space"
CLOCK = "sweep:clock"
DIRECTORY = "sweep:directory"

TRIAL_USER_ATTRS = (DEFAULT, BASELINE, RETRY_OF, ADAPTER_PATH, REASON, TOKENS, PLANNED_TOKENS)
TRIAL_SYSTEM_ATTRS = (HEARTBEAT, WORKER)
STUDY_USER_ATTRS = (SEARCH_SPACE, CLOCK, DIRECTORY)
