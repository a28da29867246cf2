"""poimen's own verification, kept out of the wheel (docs/verification.md): the kill soak
(`soak`, judged by `soak_check`; `scripts/soak`) and the model check of the call and recovery
protocol (`model`; `scripts/modelcheck`). Both import poimen, and run from the repository root."""
