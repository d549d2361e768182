"""How a pretraining run ends as a process exit code, written once for the BERT run and the
decoder run (run_pretraining.py's contract): what the user or the machine must fix (a config
or a shard refused, a checkpoint that cannot be written, a full disk, an unwritable folder) is
one line on stderr and exit 2; the process group is shut down whatever happens.

    return exit_code_of(lambda: run_training(config, output, resume))
"""

from __future__ import annotations

from collections.abc import Callable

from packed_transformers.common.cli import refuse
from packed_transformers.common.files import describe_os_error
from packed_transformers.packing.errors import PackingInputError
from packed_transformers.training.checkpoint import CheckpointError
from packed_transformers.training.data import one_line
from packed_transformers.training.distributed import shut_down_process_group
from packed_transformers.training.errors import RunError


def exit_code_of(body: Callable[[], int]) -> int:
    """body()'s exit code; RunError, CheckpointError (a checkpoint not written: its older ones
    are intact) and PackingInputError (a shard that changed or breaks the format, found at read
    time) -> their line, exit 2; OSError (a full disk, a read-only or misplaced folder) ->
    its line with the path, exit 2."""
    try:
        return body()
    except (RunError, CheckpointError, PackingInputError) as err:
        return refuse(one_line(err))
    except OSError as err:
        return refuse(describe_os_error(err))
    finally:
        shut_down_process_group()
