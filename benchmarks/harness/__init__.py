"""The benchmarks' harness: what every script in ``benchmarks/`` would otherwise set up itself,
so that a script says only what it measures.

A script run as ``python benchmarks/<name>.py`` has ``benchmarks/`` first on ``sys.path``, so
``from harness import ...`` finds this package with no path set-up (``tierstore`` must be
importable: ``pip install -e .``, as ``make`` does). Not a benchmark itself. One module per
concern:

==============  ===============================================================================
``options``     the shared command line (``benchmark_parser``, ``add_output_args``,
                ``parse_quick``, ``parse_with_cuda``) and the progress lines on stderr
``state``       the state dicts saved (``make_state_dict``) and the checks of what a load gave
                back; nested state dicts walked as DCP walks them; a raw write
``trainer``     the CPU training job of the training-loop benchmarks
``places``      temp dirs (``scratch``), their filesystems and room, output clean-up, the
                page cache
``clocks``      ``Clock`` (wall, CPU, page faults), a server's CPU, settling before a clock
``rounds``      round-robin order and warm-up rounds
``figures``     ``Samples`` per contender and round, medians, per-round ratios
``report``      markdown tables, PASS/FAIL/MISS and INFO lines, the ``--json`` document
                (configuration, machine, run time) and the ``--strict`` exit status
``servers``     a SeaweedFS S3 server of the benchmark's own (``seaweed``), free ports
``ranks``       torchrun: a script relaunching itself (``relaunch``), simulated nodes
                (``run_nodes``), the ranks' shared temp dir, slowest-rank figures, rank 0's
                exit status back to the launcher
``observers``   store observers: drain timings, staging copies
==============  ===============================================================================

A benchmark's shape, in short::

    args = parse_rounds(benchmark_parser(__doc__, 3, "imports", "parent dir"), argv)
    log = progress_log(args.quiet)
    t_start = time.perf_counter()
    with scratch("tierstore-x-", parent) as base:
        res = warmup_then_rounds(args, log, Samples, one_round)
    print_table(["contender", "median s:"], rows)
    print_verdicts(verdicts)
    return finish_report(args, config, {"figures": ..., "verdicts": verdicts}, t_start)
"""

from .clocks import Clock, proc_cpu, quiesce
from .figures import Samples, median, ratios, timing_figures
from .observers import DrainTimer, StagedEvents
from .options import (add_output_args, benchmark_parser, parse_quick, parse_rounds,
                      parse_with_cuda, parser, progress_log)
from .places import (checkpoint_files, dir_bytes, disk_parent, free_bytes, fs_type,
                     memory_parent, need_room, remove, room_problem, scratch, shm_or_tmp,
                     warm_page_cache)
from .ranks import (STATUS_ENV, barrier, finish_rank, max_over_ranks, read_status, relaunch,
                    run_nodes, run_torchrun, shared_temp_dir, temp_file, torchrun_main,
                    under_torchrun, worker_env)
from .report import (finish_report, machine, markdown_table, print_informational, print_table,
                     print_verdicts, rounds_text, verdict, write_json)
from .rounds import rotated, warmup_then_rounds
from .servers import (ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3, counts_delta, delete_prefix,
                      free_port, seaweed)
from .state import (GB, blank_like, check_equal, flat_tensors, leaves, make_state_dict,
                    mismatched_keys, nbytes_of, rank_state_dict, write_raw)
from .trainer import MlpTrainer, add_mlp_trainer_args

__all__ = [
    "ACCESS_KEY", "GB", "REGION", "SECRET_KEY", "STATUS_ENV", "Clock", "DrainTimer", "MlpTrainer",
    "Samples", "SeaweedS3", "StagedEvents", "add_mlp_trainer_args", "add_output_args", "barrier",
    "benchmark_parser", "blank_like", "check_equal", "checkpoint_files", "counts_delta",
    "delete_prefix", "dir_bytes", "disk_parent", "finish_rank", "finish_report", "flat_tensors",
    "free_bytes", "free_port", "fs_type", "leaves", "machine", "make_state_dict",
    "markdown_table", "max_over_ranks", "median", "memory_parent", "mismatched_keys", "nbytes_of",
    "need_room", "parse_quick", "parse_rounds", "parse_with_cuda", "parser",
    "print_informational", "print_table", "print_verdicts", "proc_cpu", "progress_log",
    "quiesce", "rank_state_dict", "ratios", "read_status", "relaunch", "remove", "room_problem",
    "rotated", "rounds_text", "run_nodes", "run_torchrun", "scratch", "seaweed",
    "shared_temp_dir", "shm_or_tmp", "temp_file", "timing_figures", "torchrun_main",
    "under_torchrun", "verdict", "warm_page_cache", "warmup_then_rounds", "worker_env",
    "write_json", "write_raw",
]
