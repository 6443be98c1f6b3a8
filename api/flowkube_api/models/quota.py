"""FlowQuota and ClusterFlowQuota: a team's spend and token limits over time windows (issue 41).

Both are served (``crd.KINDS``) and enforced by an operator with quotas on (the chart's
``quotas.enabled``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from flowkube_api import selectors
from flowkube_api.base import Model, Money, Time
from flowkube_api.models.common import FreeObject, cel
from flowkube_api.models.flow import NotificationRecord
from flowkube_api.report import Charge, SpentSoFar
from flowkube_api.windows import ROLLING_HOURS_LIMIT, WindowError, WindowSpec

QUOTA_LIMITS_LIMIT = 16  # limits of one quota
RETIRED_LIMIT = 2048  # entries of a quota's status.retired (past it, a model's oldest quarter hours merge)
QUOTA_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class QuotaWindow(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.kind == 'Rolling' ? has(self.hours) : !has(self.hours)",
            "window.hours is set for a Rolling window, and only for one", ".hours")]})

    kind: Literal["Day", "Week", "Month", "Rolling", "Lifetime"] = Field(
        description="Day, Week or Month: a calendar window in timeZone, starting at local midnight (a Week on "
        "weekStarts, a Month on its 1st); Rolling: the last `hours`; Lifetime: never resets.")
    time_zone: str = Field(default="UTC", max_length=64, description="IANA time zone of a calendar window.")
    hours: int | None = Field(default=None, ge=1, le=ROLLING_HOURS_LIMIT, description="A Rolling window's span.")
    week_starts: Literal["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"] = Field(
        default="Monday", description="The first day of a Week window.")

    @model_validator(mode="after")
    def _usable(self) -> QuotaWindow:
        try:
            self.spec().check()
        except WindowError as e:
            raise ValueError(str(e)) from None
        return self

    def spec(self) -> WindowSpec:
        return WindowSpec(self.kind, self.time_zone, self.hours, self.week_starts)


class QuotaLimit(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.maxTotalTokens) || has(self.maxCost)", "a limit sets maxTotalTokens, maxCost or both")]})

    name: str = Field(min_length=1, max_length=63, pattern=QUOTA_NAME, description="The limit's name in status "
                      "and messages.")
    max_total_tokens: int | None = Field(default=None, ge=1, description="Tokens the covered Flows' model calls "
                                         "may use in the window.")
    max_cost: Money | None = Field(default=None, description='USD they may cost in the window, a decimal string '
                                   '("200").')
    model: str | None = Field(default=None, max_length=512, description="Only this model's calls count (as "
                              "usage.byModel names it); unset: every model's.")
    window: QuotaWindow

    @model_validator(mode="after")
    def _capped(self) -> QuotaLimit:
        if self.max_total_tokens is None and self.max_cost is None:
            raise ValueError("a limit sets maxTotalTokens, maxCost or both")
        return self


class FlowQuotaSpec(Model):
    selector: FreeObject | None = Field(default=None, description="A label selector (matchLabels, "
                                        "matchExpressions) of the Flows it covers; unset: every Flow of the "
                                        "namespace.")
    limits: list[QuotaLimit] = Field(min_length=1, max_length=QUOTA_LIMITS_LIMIT, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    warn_at: list[Annotated[int, Field(ge=1, le=100)]] | None = Field(
        default=None, max_length=4, description="Percentages of a limit at which its Warning condition is set "
        "(default 80).")
    action: Literal["Refuse", "Queue"] = Field(
        default="Refuse", description="A new Flow while a limit is exhausted: Refuse it at apply, or Queue it "
        "(accepted, Pending with reason QuotaExhausted, started when the window resets).")

    @model_validator(mode="after")
    def _selectors(self) -> FlowQuotaSpec:
        try:
            selectors.parse(self.selector, "selector")
            selectors.parse(getattr(self, "namespace_selector", None), "namespaceSelector")
        except selectors.SelectorError as e:
            raise ValueError(str(e)) from None
        return self


class ClusterFlowQuotaSpec(FlowQuotaSpec):
    namespace_selector: FreeObject | None = Field(default=None, description="A label selector of the namespaces "
                                                  "whose Flows it covers (a team spanning namespaces).")


class LimitStatus(Model):
    name: str
    used: SpentSoFar = Field(default_factory=SpentSoFar)
    reserved: SpentSoFar = Field(default_factory=SpentSoFar, description="The worst case of calls in flight.")
    window_start: Time | None = None
    resets_at: Time | None = Field(default=None, description="When a calendar window ends; unset for rolling and "
                                   "lifetime windows.")


class QuotaCondition(Model):
    type: Literal["Ready", "Exhausted", "Warning"]
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: Time


class FlowQuotaStatus(Model):
    observed_generation: int | None = None
    summary: str | None = Field(default=None, max_length=1024, description="Each limit's share used, for "
                                "`kubectl get flowquotas` (\"daily 42%, monthly 7%\").")
    next_reset: Time | None = Field(default=None, description="The earliest resetsAt of its limits.")
    limits: list[LimitStatus] | None = None
    conditions: list[QuotaCondition] | None = None
    retired: list[Charge] | None = Field(
        default=None, max_length=RETIRED_LIMIT, description="What the Flows it covered that were deleted had "
        "charged, by quarter hour and model: it still counts in its windows (kept by the operator across restarts).")
    notifications: list[NotificationRecord] | None = Field(
        default=None, description="Per default sink of its namespace: the last QuotaWarning or QuotaExhausted "
        "delivery, and the events it is done with (as a Flow's status.notifications).")


class FlowQuota(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "FlowQuota"
    metadata: FreeObject = Field(default_factory=dict)
    spec: FlowQuotaSpec
    status: FlowQuotaStatus | None = None


class ClusterFlowQuota(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "ClusterFlowQuota"
    metadata: FreeObject = Field(default_factory=dict)
    spec: ClusterFlowQuotaSpec
    status: FlowQuotaStatus | None = None


__all__ = ["ClusterFlowQuota", "ClusterFlowQuotaSpec", "FlowQuota", "FlowQuotaSpec",
           "FlowQuotaStatus", "LimitStatus", "QuotaCondition", "QuotaLimit", "QuotaWindow"]
