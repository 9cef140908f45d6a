"""`nptrace explain` on the live lab: for every scenario, explained from the client's address
to each trigger's NodePort on the node that holds it, the prediction is the scenario's cause
(none on `healthy`); and `--confirm` traces the client's connections and observes it."""
import json
import os
import subprocess
import sys
import time

import pytest

from nptrace import lab
from nptrace.lab import model
from nptrace.lab.harness import wait_ready

pytestmark = pytest.mark.privileged
CLI = [sys.executable, "-m", "nptrace.cli"]


def _node_of(info, addr):
    for node, lst in info.nodes.items():
        if any(x.split()[1].split("/")[0] == addr for x in lst):
            return info.namespaces[node]
    raise AssertionError(f"no node holds {addr}")


@pytest.fixture
def scenario(request):
    name = request.param
    info = lab.up(name)
    yield name, info
    lab.down(name)


# explain predicts from a snapshot of the node: scenarios whose fault a step makes later
# (rules re-rendered, a pod deleted while connections are open) are out of its reach
STATIC = [s.name for s in lab.scenarios() if not lab.model.compile_spec(s.name).steps]


@pytest.mark.parametrize("scenario", STATIC, indirect=True)
def test_explain_predicts_the_scenario(scenario):
    name, info = scenario
    spec = model.compile_spec(name, None)
    for t in spec.trigger:
        r = subprocess.run(CLI + ["explain", "--from", t["src"], "--to", f"{t['dst']}:{t['port']}",
                                  "--netns", _node_of(info, t["dst"]), "-o", "json"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        pred = json.loads(r.stdout)["prediction"]
        assert pred["cause"] == (spec.cause or None), json.dumps(pred["steps"], indent=1)
        assert pred["ok"] == (not spec.cause)


@pytest.mark.parametrize("scenario", ["no-endpoints"], indirect=True)
def test_confirm_observes_the_predicted_cause(scenario, tmp_path, root_and_bcc):
    name, info = scenario
    t = model.compile_spec(name, None).trigger[0]
    ready = tmp_path / "ready"
    env = dict(os.environ, NPTRACE_LOCK_FILE=str(tmp_path / "lock"))
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        p = subprocess.Popen(CLI + ["explain", "--from", t["src"], "--to", f"{t['dst']}:{t['port']}",
                                    "--netns", _node_of(info, t["dst"]), "--confirm", "6",
                                    "--ready-file", str(ready)], stdout=out, stderr=err, env=env)
        try:
            wait_ready(ready, p, stderr=tmp_path / "err")
            time.sleep(0.3)
            lab.trigger(name, count=5)
            assert p.wait(timeout=60) == 0, (tmp_path / "err").read_text()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = (tmp_path / "out").read_text()
    assert "predicted: no_endpoints" in text
    assert "observed in 6 s: no_endpoints" in text and "(as predicted)" in text, text
