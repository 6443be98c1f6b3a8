"""Reading a run's report: from the Flow's state ConfigMap (what the runner stored through the state
API), or from the summary in its pod's termination message, whichever says more."""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Any

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.report import RunReport
from flowkube_operator.kube.client import Kube, ns_path
from flowkube_operator.meta import PodView, owner_uid

Body = dict[str, Any]
log = logging.getLogger("flowkube.reports")


async def load_report(kube: Kube, ns: str, name: str, uid: str, pod_name: str,
                      pod: PodView | None) -> RunReport | None:
    """The run's report from the state ConfigMap, or the summary in the termination message.

    The ConfigMap holds the interim report (usage after every LLM call) until the final one
    replaces it; if that final write failed, the termination message has the outcome and the
    interim report still has every token, with the per-model breakdown.
    """
    cm = await kube.get(ns_path(ns, "configmaps", c.state_configmap_name(name)))
    if cm is not None and owner_uid(cm["metadata"]) != uid:
        cm = None  # an earlier Flow's state, about to be garbage-collected: not this run's report
    raw = ((cm or {}).get("binaryData") or {}).get(c.report_key(pod_name))
    stored = summary = None
    # Each on its own: an unreadable (or oversized) stored report must not hide the summary.
    try:
        if raw:
            stored = RunReport.decode(base64.b64decode(raw))
    except (ValidationError, OSError, ValueError, binascii.Error) as e:
        log.warning("unreadable report of %s/%s in its state ConfigMap: %s", ns, pod_name, e)
    try:
        if pod is not None and pod.message and pod.message.lstrip().startswith("{"):
            summary = RunReport.model_validate_json(pod.message)
    except (ValidationError, ValueError) as e:
        log.warning("unreadable termination message of %s/%s: %s", ns, pod_name, e)
    if stored is not None and summary is not None and summary.pod == pod_name and summary.further_than(stored):
        # The stored report stopped (state writes failed for a while; a warm runner's later
        # turns): the summary has the outcome and the totals, the stored one the per-model split.
        return summary.model_copy(update={"usage": stored.usage.at_least(summary.usage.totals())})
    return stored or summary


async def active_report(kube: Kube, key: tuple[str, str], uid: str, pods: dict[str, PodView], run: Body,
                        hinted: bool, hint: RunReport | None) -> tuple[RunReport | None, bool]:
    """(the active run's report, whether it was read): read when its pod has ended, or when the
    state API took a warm report (``hint``; None: read it). ``pods`` gains the active pod if the
    cache lost it but it is there."""
    active = run["pod"]
    if active not in pods and run.get("startedAt"):
        # The cache says the pod is gone; make sure before counting the run as lost.
        live = await kube.get(ns_path(key[0], "pods", active))
        view = PodView.from_pod(live) if live is not None else None
        if view is not None and view.owner_uid == uid:
            pods[active] = view
    if active in pods and pods[active].terminated:
        return await load_report(kube, *key, uid, active, pods[active]), True
    if active in pods and hinted:
        if hint is not None and hint.pod == active:
            return hint, True
        return await load_report(kube, *key, uid, active, None), True
    return None, False
