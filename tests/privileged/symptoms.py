"""What a lab scenario's client and load balancer see while its fault is there: checked for
every yardstick case (test_attribution.py, nptrace attached) and for the lab cases the
yardstick does not run (test_lab_symptoms.py, no tracer). With nptrace attached is as good a
witness as without: `healthy` under the same tracer gets every connection through, so a
symptom is the lab's, not the tracer's."""
import collections
import json

NODEPORT_LOCAL = 30081     # the eTP=Local Service's NodePort (topology.toml)


def check_symptom(name: str, attempts, view) -> None:
    """attempts: the trigger's; view: lab.lb_view() taken while the lab was up."""
    seen = collections.Counter(a.outcome for a in attempts)
    if name == "healthy":
        assert seen == {"ok": len(attempts)}, seen
        # eTP=Cluster is masqueraded (pods see a node address), eTP=Local keeps the client's
        for a in attempts:
            client_seen = f"peer={a.src}:" in a.reply
            assert client_seen == (a.dport == NODEPORT_LOCAL), a
    else:
        assert sum(a.expected for a in attempts) >= 0.98 * len(attempts), seen
        assert "ok" not in seen, seen
    for v in view:
        assert v["status"] == v["expect"], v
        body = json.loads(v["body"])
        assert body["service"] == {"namespace": "default", "name": body["service"]["name"]}
        assert (body["localEndpoints"] > 0) == (v["status"] == 200)
