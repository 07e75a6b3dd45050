"""Trace analysis: a rank's chrome trace read (`trace`), the collectives per step and their hidden time
(`collectives`), the overlap the graded checks judge (`schedule`), memory per phase (`memory_analysis`),
a run's ranks together (`analysis`) and its pictures (`pictures`)."""
