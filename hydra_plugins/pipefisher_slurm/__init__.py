"""pipefisher's Hydra launcher plugin: hydra-submitit's SLURM launcher that shows a sweep's progress
and cancels its jobs on Ctrl-C (:class:`~hydra_plugins.pipefisher_slurm.sweep_launcher.SweepSlurmLauncher`).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace package, so the class lives
here; what it does is in ``pipefisher.launch.sweep``.
"""
