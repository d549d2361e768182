"""Pretraining from a YAML config: BERT phase 2 on packed sequences (MLPerf style), or a decoder
(a config whose model.family names one: MLPerf 5.1's llama31_8b rules, training/decoder/).

    python run_pretraining.py --config configs/demo.yaml [--set section.key=value ...]
                              [--output-dir DIR] [--resume] [--compile-only]
    torchrun --nproc-per-node N run_pretraining.py --config ...      (DDP replicas)

Exit codes: 0 done, 2 bad config / data / checkpoint / output folder (nothing computed),
143 stopped by SIGTERM after writing a checkpoint (rerun with --resume).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from packed_transformers.common.cli import add_verbose_option, command_parser, refuse
from packed_transformers.common.input_limits import MAX_GPU_MEMORY_GIB, MAX_PLAN_GPUS


def parse_args(argv=None):
    parser = command_parser("run_pretraining.py", __doc__)
    parser.add_argument("--config", required=True, help="YAML run configuration (see configs/README.md)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key"
    )
    parser.add_argument("--output-dir", help="run folder (default: runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    add_verbose_option(parser)
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="IPU: compile the executables (timed; cached in ipu.executable_cache_dir) and stop; "
        "the output folder is not written",
    )
    plan = parser.add_argument_group(
        "memory plan (decoder configs; nothing is allocated, trained or written)"
    )
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the memory per rank and the GPUs the config needs, then stop",
    )
    plan.add_argument("--gpus", type=int, default=8, help="GPUs the plan spreads the run over")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    args = parser.parse_args(argv)
    if args.plan and not 1 <= args.gpus <= MAX_PLAN_GPUS:
        parser.error(f"--gpus must be between 1 and {MAX_PLAN_GPUS:,}, got {args.gpus}")
    if args.plan and not 0 < args.gpu_memory_gib <= MAX_GPU_MEMORY_GIB:  # NaN and inf fail too
        parser.error(f"--gpu-memory-gib must be a size above 0 and at most {MAX_GPU_MEMORY_GIB:,.0f}, "
                     f"got {args.gpu_memory_gib:g}")  # fmt: skip
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from packed_transformers.common.preflight import path_mistake

    mistake = path_mistake("--config", args.config, "file")  # before torch is imported
    if mistake:
        return refuse(mistake)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from packed_transformers.common.config_schema import read_yaml
    from packed_transformers.training.config import ConfigError
    from packed_transformers.training.specs import spec_of

    try:
        raw = read_yaml(args.config)  # read once; the job (training.specs) picked once
        spec = spec_of(raw)
        config = spec.load_config(raw, args.set, args.config, args.compile_only)
    except ConfigError as err:
        return refuse(err)
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    # its "Writing model shards" bar at every checkpoint repeats our log line
    quiet_transformers(args.verbose)
    if args.plan:
        if spec.plan is None:
            return refuse(f"--plan: {args.config} is a {spec.title} config; the memory plan is for decoder configs "
                          "(model.family)")  # fmt: skip
        return spec.plan(config, args.config, args.gpus, args.gpu_memory_gib)
    problem = spec.preflight(config, args.config)
    if problem:
        return refuse(problem)
    return spec.run(config, Path(args.output_dir or Path("runs") / Path(args.config).stem), args.resume)


if __name__ == "__main__":
    sys.exit(main())
