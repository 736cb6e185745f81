"""A calibrated event-timeline model of context-parallel training (issue 23).

Predictions, not measurements: every number this package writes is labelled as a prediction.
Modules: :mod:`.params` (cluster parameters and their provenance), :mod:`.calibrate` (attention
and matmul cost fitted from H200 measurements), :mod:`.layout` (what the model reads from
``flashmask3.distributed.plan``), :mod:`.timeline` (the per-rank event timeline of one layer),
:mod:`.model` (model, layout, step time), :mod:`.experiment` (the FlashMask-3 experiment and the
cp sweep), :mod:`.validate` (errors against committed multi-GPU / per-rank measurements),
:mod:`.measure` (the GPU calibration run). CLI: ``python -m benchmarks.scale_model --help``.
See docs/scale-model.md.
"""
