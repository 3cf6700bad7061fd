"""``phalanx export RUN_DIR --format ... [--quantize ...]``.

Examples:
    $ phalanx export runs/demo --format litert --quantize int8
    $ phalanx export runs/demo --format keras --quantize int4-weight --output served/demo-int4
    $ phalanx export runs/demo --format litert --overwrite          # replaces runs/demo/export/litert-none
    $ phalanx export runs/demo --format litert --quantize int8 --calibration-batches 16 train.eval_batches=50
"""

from __future__ import annotations

import argparse
import json

from phalanx.config import ConfigError, require_directory
from phalanx.export import calibration
from phalanx.export.api import export_run
from phalanx.export.formats import FORMATS, QUANTIZE_MODES, UNSUPPORTED, check_request


def _epilog() -> str:
    lines = ["supported --format x --quantize pairs:"]
    for fmt in FORMATS:
        ok = [m for m in QUANTIZE_MODES if (fmt, m) not in UNSUPPORTED]
        lines.append(f"  {fmt:<11} {', '.join(ok)}")
    lines += ["", "The export directory (default RUN_DIR/export/FORMAT-QUANTIZE; an existing one is refused",
              "unless --overwrite, and then only a previous export) holds the model, export.json,",
              "export_report.json (size, held-out loss/perplexity, tokens/s beside the float model), and",
              "the run's config.yaml and tokenizer/: `phalanx eval` and `phalanx generate` accept it."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx export", epilog=_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Export the latest checkpoint of a run as a servable model, "
                                                 "quantized if asked, and report its quality beside the float model.")
    parser.add_argument("run_dir", help="a run directory made by `phalanx train`")
    parser.add_argument("overrides", nargs="*", help="section.key=value for the run's config, e.g. "
                        "train.eval_batches=50 or data.source=DIR (anywhere among the flags)")
    parser.add_argument("--format", required=True, help=f"{' | '.join(FORMATS)}")
    parser.add_argument("--quantize", default="none", help=f"{' | '.join(QUANTIZE_MODES)} (default none)")
    parser.add_argument("--calibration-batches", type=int, default=calibration.DEFAULT_BATCHES,
                        help=f"training batches that calibrate int8 (default {calibration.DEFAULT_BATCHES})")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="held-out batches to score (default train.eval_batches of the run)")
    parser.add_argument("--output", default=None, help="export directory, which must not exist (default "
                        "RUN_DIR/export/FORMAT-QUANTIZE)")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous export at the output (never "
                        "anything else: a run directory, a file, a folder export did not write)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    ns = parser.parse_intermixed_args(argv)
    require_directory("run_dir", ns.run_dir)
    if ns.eval_batches is not None and ns.eval_batches < 1:
        raise ConfigError("--eval-batches", f"must be >= 1, got {ns.eval_batches}")
    check_request(ns.format, ns.quantize)  # before TensorFlow starts: a bad flag fails at once
    try:
        report = export_run(ns.run_dir, ns.format, ns.quantize, calibration_batches=ns.calibration_batches,
                            output=ns.output, overwrite=ns.overwrite, overrides=ns.overrides,
                            eval_batches=ns.eval_batches, quiet=ns.quiet, print_table=not ns.json)
    except OSError as err:  # reading the run (a disk error, permissions): one line naming the file
        raise ConfigError(str(err.filename or ns.run_dir), f"{err.strerror or err}; nothing was exported") from None
    if ns.json:
        print(json.dumps(report, default=str))
    return 0
