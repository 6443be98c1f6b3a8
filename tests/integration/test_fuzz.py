"""The abuse suite: hypothesis-generated Flow specs, status patches and state-API requests against
the real operator (the chart's pod on the real node), beside a well-behaved Flow run by the real
runner against the stub model.

Every generated input is untrusted bytes: sizes up to past the API server's limits, nesting past any
parser's comfort, gzip bombs, the operator's reserved names, bursts. The suite asserts what a
platform team relies on: each input is refused with a 4xx naming the problem, or admitted, never a
webhook failure or a 5xx; the operator's containers never restart and stay under their memory
limit; the Lease keeps its holder (its renewals stayed within the renew deadline); the paused Flow's
request stays pending through every wrong patch; and the well-behaved Flow, answered afterwards,
ends with usage equal to the stub model's ledger.

Budget: FLOWKUBE_FUZZ_EXAMPLES examples of each kind (25 in `./dev test`);
`FLOWKUBE_FUZZ_EXAMPLES=500 ./dev test tests/integration/test_fuzz.py` is the longer run.
"""

from __future__ import annotations

import gzip
import json
import os
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowkube_api import constants as c
from flowkube_devstack.cluster import LocalCluster
from tests.abuse import gzip_bomb
from tests.integration.conftest import Flows, LeaseWatch
from tests.integration.realrunner import RealRunnerStack, real_runner_stack
from tests.integration.test_abuse import operator_rss, restarts
from tests.integration.test_e2e_runner import RULES, RUN_TIMEOUT, review_definition, usage_of

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("FLOWKUBE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.function_scoped_fixture])

# -- what is generated -------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=40)


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


big_values: st.SearchStrategy[Any] = st.one_of(
    st.integers(1, 400).map(nested),  # deep
    st.integers(1, 500_000).map(lambda n: [[] for _ in range(n)]),  # wide: 3 bytes of JSON each
    st.integers(1, 1_400_000).map(lambda n: "x" * n),  # long
)
env_names = st.one_of(st.sampled_from(["FLOWKUBE_STATE_DIR", "FLOWKUBE_TERMINATION_LOG", "FLOWKUBE_PRIOR_COST",
                                       "FLOWKUBE_", "HOME", "OPENAI_API_KEY"]),
                      st.text(min_size=1, max_size=30))
specs = st.fixed_dictionaries({"flowRef": st.just("a:B"), "suspend": st.just(True)}, optional={
    "inputs": st.dictionaries(st.text(max_size=8), json_values | big_values, max_size=3),
    "env": st.lists(st.fixed_dictionaries({"name": env_names}, optional={"value": st.text(max_size=50)}),
                    max_size=4),
    "envFrom": st.lists(st.fixed_dictionaries({"configMapRef": st.just({"name": "c"})},
                                              optional={"prefix": env_names}), max_size=2),
    "podTemplate": st.fixed_dictionaries({}, optional={
        "priorityClassName": st.sampled_from(["system-cluster-critical", "high"]),
        "tolerations": st.lists(st.dictionaries(st.sampled_from(["key", "operator", "effect"]),
                                                st.text(max_size=20)), max_size=3),
        "affinity": json_values | big_values}),
    "budget": st.fixed_dictionaries({"maxTotalTokens": st.integers(-5, 10**12)}),
})


def gzip_of(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


bodies = st.one_of(
    st.binary(max_size=2048),
    json_values.map(lambda v: gzip_of(json.dumps(v).encode())),  # gzip, but not a report
    st.integers(2, 400).map(lambda mib: gzip_bomb(mib << 20)),
    st.integers(900 * 1024, 2_200_000).map(lambda n: os.urandom(n)),  # over the value and body limits
)


# -- the stack ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[RealRunnerStack]:
    with real_runner_stack(cluster, RULES, "fuzz") as s:
        yield s


def bound_token(cluster: LocalCluster, namespace: str, pod: str) -> str:
    uid = cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "jsonpath={.metadata.uid}").stdout
    return cluster.kubectl("create", "token", "default", "-n", namespace, f"--audience={c.STATE_AUDIENCE}",
                           "--bound-object-kind=Pod", f"--bound-object-name={pod}", f"--bound-object-uid={uid}",
                           "--duration=30m").stdout.strip()


def refused_cleanly(stderr: str) -> bool:
    """A refusal from the API server, the CRD or our webhook: not a webhook that failed or timed out."""
    broken = ("failed calling webhook", "(InternalError)", "context deadline exceeded", "connection refused",
              "Internal error occurred", "unexpected EOF")
    refused = "Error from server" in stderr or " is invalid: " in stderr
    return refused and not any(b in stderr for b in broken)


def test_abuse_beside_a_well_behaved_flow(stack: RealRunnerStack, flows: Flows) -> None:
    op, cluster = stack.operator, stack.cluster
    mark = len(stack.stub.ledger())
    flows.apply("steady", {"definition": review_definition(), "feedback": {"keepWarmSeconds": 900}})
    paused = flows.wait_phase("steady", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    request = paused["feedback"]["request"]
    (pod,) = [p["metadata"]["name"] for p in flows.pods("steady")]
    before, holder = restarts(op), op.leader()
    counts: dict[str, int] = {}
    lease = LeaseWatch(op.lease)  # read every half second while the abuse runs (retry period 1 s)

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    # 1. Flow specs, through kubectl as a tenant applies them.
    @FUZZ
    @given(spec=specs)
    def apply_specs(spec: dict[str, Any]) -> None:
        obj = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"generateName": "fuzz-"}, "spec": spec}
        out = cluster.kubectl("create", "-n", flows.ns, "-f", "-", "-o", "name", input=json.dumps(obj), check=False)
        assert out.returncode == 0 or refused_cleanly(out.stderr), out.stderr[:2000]
        count("spec admitted" if out.returncode == 0 else "spec refused")
        if out.returncode == 0:
            cluster.kubectl("delete", "-n", flows.ns, out.stdout.strip(), "--wait=false", check=False)

    apply_specs()

    # 2. Status patches on the paused Flow: none of these is a valid answer, so each is refused and
    # the request stays (a generated valid answer would resume the flow: answers carry a wrong id).
    # (Never null: in a merge patch null removes a field, and removing one that is not there changes
    # nothing, which is admitted.)
    present = (json_values | big_values).filter(lambda v: v is not None)
    wrong_answers = st.one_of(
        present.filter(lambda v: not isinstance(v, dict)),
        st.dictionaries(st.text(max_size=12), json_values, max_size=4).map(lambda d: {**d, "bogus": 1}))
    patches = st.one_of(
        st.fixed_dictionaries({"feedback": st.fixed_dictionaries({"response": st.fixed_dictionaries(
            {"text": st.text(max_size=200), "requestId": st.text(max_size=20).map(lambda s: "not-" + s)})})}),
        st.fixed_dictionaries({"feedback": st.fixed_dictionaries({"response": wrong_answers})}),
        st.dictionaries(st.sampled_from(["phase", "usage", "runs", "message", "conditions", "result"]),
                        present, min_size=1, max_size=2),
    )

    @FUZZ
    @given(patch=patches)
    def patch_status(patch: dict[str, Any]) -> None:
        rc, out = flows.patch_status("steady", {"status": patch})
        assert rc != 0 and refused_cleanly(out), out[:2000]
        count("patch refused")

    patch_status()
    assert flows.status("steady")["feedback"]["request"]["id"] == request["id"]

    # 3. State-API requests with the waiting pod's own token, as code in that pod could send them.
    state = httpx.Client(base_url=op.state_url, verify=ssl.create_default_context(cafile=str(op.ca_file())),
                         timeout=30, headers={"Authorization": f"Bearer {bound_token(cluster, flows.ns, pod)}"})
    # 422: gzip JSON that is not a run report, refused naming the field (400: not gzip JSON at all).
    ok_codes = {200, 204, 400, 403, 404, 405, 409, 410, 413, 422, 429}

    def send(method: str, key: str, body: bytes | None = None) -> int:
        response = state.request(method, c.STATE_API_PREFIX + key, content=body,
                                 extensions={"sni_hostname": op.state_server_name})
        return response.status_code

    @FUZZ
    @given(key=st.one_of(st.just(c.report_key(pod)), st.just(c.report_key("other-0")),
                         st.text(st.characters(min_codepoint=0x21, exclude_characters="/?#%\\\x7f"),
                                 max_size=60).filter(lambda k: k not in (".", ".."))),
           body=bodies, burst=st.integers(1, 12))
    def state_requests(key: str, body: bytes, burst: int) -> None:
        if key == c.STATE_KEY:
            return  # the Flow's saved state: overwriting it is the pod's right, not an attack on others
        codes: list[int] = []
        threads = [threading.Thread(target=lambda: codes.append(send("PUT", key, body))) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes.append(send("GET", key))
        assert set(codes) <= ok_codes, codes
        for code in codes:
            count(f"state {code}")

    state_requests()
    state.close()

    # What the abuse did not do.
    longest_gap = lease.stop()
    assert longest_gap < 7.0, f"the Lease went {longest_gap:.1f}s without a renewal (renew deadline 7 s)"
    assert restarts(op) == before, op.diagnose()
    assert op.leader() == holder and "leadership lost" not in op.logs()
    rss = operator_rss(op, cluster) if len(op.pods()) == 1 else 0.0
    assert rss < 400
    print(f"\nabuse ({EXAMPLES} examples of each kind): {dict(sorted(counts.items()))}; operator RSS {rss:.0f} MB; "
          f"{len(lease.renewals)} Lease renewals seen, the longest gap {longest_gap:.2f} s")

    # The well-behaved Flow, answered now, counts every call the model served, once.
    flows.patch_status("steady", {"status": {"feedback": {"response": {"text": "approved"}}}})
    done = flows.wait_phase("steady", "Succeeded", timeout=RUN_TIMEOUT)
    assert usage_of(done) == stack.usage_since(mark), "status.usage must equal the stub model's ledger"
