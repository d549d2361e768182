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
    from packed_transformers.training.config import ConfigError, validate_raw
    from packed_transformers.training.decoder.config import is_decoder_config, load_decoder_config

    try:
        raw = read_yaml(args.config)  # read once; model.family chooses decoder pretraining, asked once
        decoder = is_decoder_config(raw)
        if decoder:
            if args.compile_only:
                raise ConfigError(
                    "--compile-only: only PopTorch compiles ahead of time; a decoder runs on cpu or cuda"
                )
            config = load_decoder_config(raw, args.set, args.config)
        else:
            overrides = args.set + (["execution.compile_only=true"] if args.compile_only else [])
            config = validate_raw(raw, overrides, args.config)
    except ConfigError as err:
        return refuse(err)
    if args.plan:
        if not decoder:
            return refuse(
                f"--plan: {args.config} is a BERT config; the memory plan is for decoder configs (model.family)"
            )
        from packed_transformers.model.hf_checkpoint import quiet_transformers
        from packed_transformers.training.decoder.memory_plan import print_plan

        quiet_transformers(args.verbose)
        return print_plan(config, args.config, args.gpus, args.gpu_memory_gib)
    output = Path(args.output_dir or Path("runs") / Path(args.config).stem)
    if decoder:
        from packed_transformers.model.hf_checkpoint import quiet_transformers
        from packed_transformers.training.decoder.run import run_decoder

        quiet_transformers(args.verbose)
        return run_decoder(config, output, args.resume)
    from packed_transformers.model.hf_checkpoint import quiet_transformers

    quiet_transformers(
        args.verbose
    )  # its "Writing model shards" bar at every checkpoint repeats our log line
    from packed_transformers.training.prerequisites import missing_prerequisites, prerequisites_line

    # Two or more things missing: all named in one line before any data is opened (one
    # alone is the run's own precise message; IPU configs first need poptorch, which the
    # IPU engine's check_config names before anything else).
    missing = missing_prerequisites(config)
    if len(missing) >= 2 and config["execution"]["device"] in ("cpu", "cuda"):
        return refuse(prerequisites_line(args.config, missing))
    from packed_transformers.training.run import run

    return run(config, output, args.resume)


if __name__ == "__main__":
    sys.exit(main())
