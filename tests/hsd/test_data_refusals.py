"""Bad data is refused before anything starts: `hsd launch` and `hsd dispatcher` exit 2 with one
line naming the file and the first bad sample, having created nothing; a worker that meets a data
error exits with the unusable code, which `hsd launch` does not restart."""

from __future__ import annotations

import json

from hsd_testing import hsd
from prepared_data import write_prepared

from common.run.prepared import LENGTHS_FILE, TOKENS_FILE
from common.worker.runtime import EXIT_UNUSABLE


def test_launch_and_dispatcher_refuse_a_dataset_missing_lengths(tmp_path):
    data = write_prepared(tmp_path / "data", [5 + i % 7 for i in range(120)])
    lines = (data / LENGTHS_FILE).read_text().splitlines(keepends=True)
    (data / LENGTHS_FILE).write_text("".join(lines[:100]))
    for command in ("launch", "dispatcher"):
        run_dir = tmp_path / command
        proc = hsd(command, f"run.dir={run_dir}", f"data.path={data}", check=False, timeout=60)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines() == [
            f"hsd {command}: error: {data / LENGTHS_FILE} holds 100 lengths but manifest.json says 120 samples: "
            f"sample 100 (line 101) and later have none (a cut-short file?): run hsd prepare again"]
        assert not run_dir.exists()  # nothing started: no run directory, no log, no worker


def test_a_target_given_damaged_data_exits_unusable(tmp_path):
    data = write_prepared(tmp_path / "data", [5 + i % 7 for i in range(20)])
    with open(data / TOKENS_FILE, "r+b") as f:
        f.truncate(40)
    model = tmp_path / "model"  # the dataset is opened before the model is loaded: its config is enough
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 12,
                                                   "hidden_size": 64}))
    proc = hsd("target", f"run.dir={tmp_path / 'run'}", "target.sim=false", f"target.model={model}",
               f"data.path={data}", check=False, timeout=120)
    assert proc.returncode == EXIT_UNUSABLE, (proc.stdout, proc.stderr)
    assert str(data) in proc.stderr and "run hsd prepare again" in proc.stderr and "Traceback" not in proc.stderr
