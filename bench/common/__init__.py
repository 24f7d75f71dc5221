"""What every study shares, below every study: result records (``records``), the environment record
(``environment``), progress bars (``progress``), per-step timing of the real engine (``step_timing``),
serving metrics (``serving_metrics``) and SLOs (``slo``), and sweeps over local processes or Ray
(``sweep_runner``). Imports nothing from a study."""
