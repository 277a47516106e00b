"""``qpass study``: QUADS ablations on the default model (operand ablation, RAC sweep, cost)."""

from qpass.apps.study.run import (
    QUICK_RATIOS,
    StudyConfig,
    build_parser,
    config_from_args,
    main,
    run_study,
    write_outputs,
)

__all__ = ["QUICK_RATIOS", "StudyConfig", "build_parser", "config_from_args", "main", "run_study", "write_outputs"]
