import json

import numpy as np
import pytest

from common.run.config import ConfigError
from common.run.records.rundir import (LENGTHS_FILE, STATE_FILE, DispatcherState, check_free_space, read_run_lengths,
                                       read_state_file, write_run_lengths, write_state_file)

OLD_STATE = {"pid": 4242, "host": "node-a", "run_id": "run-1", "control": "ipc:///tmp/c", "stats": "ipc:///tmp/s",
             "started": 1700000000.25}


def test_a_state_file_written_before_the_typed_record_reads(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps(OLD_STATE))  # as the dispatcher wrote it with json.dumps
    assert read_state_file(tmp_path) == DispatcherState(**OLD_STATE)


def test_the_state_file_round_trips_as_the_same_json(tmp_path):
    write_state_file(tmp_path, DispatcherState(**OLD_STATE))
    assert json.loads((tmp_path / STATE_FILE).read_text()) == OLD_STATE
    assert read_state_file(tmp_path).pid == 4242


def test_no_state_file_or_a_partial_one_reads_as_none(tmp_path):
    assert read_state_file(tmp_path) is None
    (tmp_path / STATE_FILE).write_text('{"pid": 42')
    assert read_state_file(tmp_path) is None


def test_run_lengths_round_trip_memory_mapped(tmp_path):
    assert read_run_lengths(tmp_path) is None
    write_run_lengths(tmp_path, [5, 9, 3])
    lengths = read_run_lengths(tmp_path)
    assert lengths.tolist() == [5, 9, 3] and isinstance(lengths, np.memmap)
    assert (tmp_path / LENGTHS_FILE).is_file() and not list(tmp_path.glob("*.tmp*"))


def test_free_space_below_what_a_run_needs_is_refused_by_name(tmp_path):
    check_free_space(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"run\.dir .* free, less than"):
        check_free_space(tmp_path, 1 << 40)
