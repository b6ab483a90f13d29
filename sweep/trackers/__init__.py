"""Experiment trackers (the study file's ``trackers:``): MLflow, Weights & Biases and TensorBoard see every trial.

    base          the ``Tracker`` protocol every tracker implements, and what it is given
    process       the run's side of the trackers' process: started (before torch's import, with ``sweep run``),
                  told the study, ended
    sync          the process copying results.db to the trackers, their run ids in trackers.json
    _guards       that process's bounds: its output without passwords, trackers.json checked, the study directory's
                  holder, a server's calls given bounded time
    _mlflow       MLflow: the study a parent run, each trial a nested run
    _wandb        Weights & Biases: a run per trial, grouped by study (offline by default)
    _tensorboard  TensorBoard: a run folder per trial

Each tracker's package is imported only by its own module, in the trackers' process.
"""
