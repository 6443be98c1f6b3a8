"""CronFlows: a schedule, the Flow it starts, what it has started."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowkube_api.base import Model, Time
from flowkube_api.models.common import (
    FreeObject,
)
from flowkube_api.models.spec import (
    NewFlowSpec,
    PodTemplateMetadata,
)
from flowkube_api.report import Usage


class CronFlowTemplate(Model):
    metadata: PodTemplateMetadata | None = Field(default=None, description="Labels and annotations of each Flow.")
    spec: NewFlowSpec = Field(description="The spec of each Flow the CronFlow starts.")


class CronFlowSpec(Model):
    schedule: str = Field(min_length=1, max_length=256, description="Cron syntax, five fields as in a CronJob "
                          "(minute hour day-of-month month day-of-week), or @hourly, @daily, @weekly, @monthly, "
                          "@yearly.")
    time_zone: str | None = Field(default=None, max_length=64,
                                  description="IANA time zone of the schedule (default UTC), e.g. Europe/Berlin.")
    flow_template: CronFlowTemplate
    concurrency_policy: Literal["Allow", "Forbid", "Replace"] | None = Field(
        default=None, description="While a Flow it started still runs: Allow (the default) starts the next one "
        "too; Forbid skips the new time; Replace deletes the running Flow and starts the new one.")
    starting_deadline_seconds: int | None = Field(
        default=None, ge=0, description="A time missed by more than this (the operator was down, Forbid waited) "
        "is skipped. No value: a missed time is started however late.")
    successful_flows_history_limit: int | None = Field(
        default=None, ge=0, le=1000, description="Succeeded Flows kept (default 3); older ones are deleted.")
    failed_flows_history_limit: int | None = Field(
        default=None, ge=0, le=1000, description="Failed Flows kept (default 1); older ones are deleted.")
    suspend: bool | None = Field(default=None, description="true: no new Flows; times that pass meanwhile are "
                                 "missed (started when resumed only within startingDeadlineSeconds).")


class CronFlowSkip(Model):
    time: Time = Field(description="The scheduled time that did not start a Flow.")
    reason: str = Field(description="ConcurrencyForbidden, MissedDeadline or FailedCreate.")
    message: str = ""


class CronFlowStatus(Model):
    observed_generation: int | None = None
    last_schedule_time: Time | None = Field(default=None, description="The latest time a Flow was started for.")
    last_successful_time: Time | None = Field(default=None, description="When a Flow it started last Succeeded.")
    active: list[str] | None = Field(default=None, description="Its Flows that have not ended.")
    last_skipped: CronFlowSkip | None = None
    usage: Usage | None = Field(default=None, description="Every Flow it started, summed: those that exist and "
                                "those its history limits deleted.")
    pruned_usage: Usage | None = Field(default=None, description="The part of usage from Flows the history "
                                       "limits deleted.")
    pruning: list[str] | None = Field(default=None, description="uids of Flows being deleted by the history "
                                      "limits, whose usage is in prunedUsage already.")


class CronFlow(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "CronFlow"
    metadata: FreeObject = Field(default_factory=dict)
    spec: CronFlowSpec
    status: CronFlowStatus | None = None
