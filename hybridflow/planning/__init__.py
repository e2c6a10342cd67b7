"""`hybridflow plan`: a layout's resharding traffic, switch time and per-rank memory, from a model
config alone (no torch model, no processes), and the same model as `hybridflow train`'s pre-flight
memory check. See docs/planning.md.

    arch.py       model architectures: presets and HF config.json -> parameter shapes
    cost.py       the stated cost model: switch seconds and the per-rank memory plan
    search.py     valid layouts, ranked; why a layout is invalid
    calibrate.py  bandwidth and latency measured on this machine's collectives
    preflight.py  the memory check `hybridflow train` runs before any worker starts
    cli.py        the command line
"""
