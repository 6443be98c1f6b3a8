"""The resources (flowkube.io/v1alpha1) as pydantic models: the single source of the CRDs' schemas.

One module per kind: spec.py (a Flow's spec), flow.py (its status and the Flow), template.py
(FlowTemplate, ClusterFlowTemplate), cronflow.py (CronFlow); common.py holds what they share.

Field names follow the contract in docs/api.md. Pod-shaped fields (env, envFrom, tolerations, affinity, ...)
keep Kubernetes' own shapes and are validated by the API server again when the runner pod is created.
"""


from __future__ import annotations

from flowkube_api.base import Model
from flowkube_api.models.common import (
    DNS_SUBDOMAIN,
    FLOW_REF_PATTERN,
    IMAGE_REFERENCE_PATTERN,
    AnyJson,
    FlowRef,
    FreeObject,
    FreeObjectList,
    IntOrString,
    ParameterType,
    cel,
)
from flowkube_api.models.cronflow import CronFlow, CronFlowSkip, CronFlowSpec, CronFlowStatus, CronFlowTemplate
from flowkube_api.models.flow import (
    Condition,
    ConversationMessage,
    ConversationStatus,
    FeedbackRecord,
    FeedbackResponse,
    FeedbackStatus,
    Flow,
    FlowStatus,
    MessageInbox,
    NotificationRecord,
    PendingFeedback,
    PendingMessage,
    Result,
    Run,
    TemplateStatus,
)
from flowkube_api.models.spec import (
    Budget,
    BudgetLimit,
    ConversationSpec,
    EnvFromSource,
    EnvVar,
    FeedbackSpec,
    FlowDefinitionSpec,
    FlowFields,
    FlowSpec,
    LocalObjectReference,
    NewFlowSpec,
    NotificationSecretRef,
    NotificationSink,
    PodTemplate,
    PodTemplateMetadata,
    ResourceRequirements,
    Retries,
    TemplateRef,
)
from flowkube_api.models.template import (
    ClusterFlowTemplate,
    FlowTemplate,
    FlowTemplateSpec,
    TemplateFlowSpec,
    TemplateParameter,
)
from flowkube_api.report import FeedbackRequest, TokenUsage, Usage

__all__ = [
    "DNS_SUBDOMAIN",
    "FLOW_REF_PATTERN",
    "IMAGE_REFERENCE_PATTERN",
    "AnyJson",
    "Budget",
    "BudgetLimit",
    "ClusterFlowTemplate",
    "Condition",
    "ConversationMessage",
    "ConversationSpec",
    "ConversationStatus",
    "CronFlow",
    "CronFlowSkip",
    "CronFlowSpec",
    "CronFlowStatus",
    "CronFlowTemplate",
    "EnvFromSource",
    "EnvVar",
    "FeedbackRecord",
    "FeedbackRequest",
    "FeedbackResponse",
    "FeedbackSpec",
    "FeedbackStatus",
    "Flow",
    "FlowDefinitionSpec",
    "FlowFields",
    "FlowRef",
    "FlowSpec",
    "FlowStatus",
    "FlowTemplate",
    "FlowTemplateSpec",
    "FreeObject",
    "FreeObjectList",
    "IntOrString",
    "LocalObjectReference",
    "MessageInbox",
    "Model",
    "NewFlowSpec",
    "NotificationRecord",
    "NotificationSecretRef",
    "NotificationSink",
    "ParameterType",
    "PendingFeedback",
    "PendingMessage",
    "PodTemplate",
    "PodTemplateMetadata",
    "ResourceRequirements",
    "Result",
    "Retries",
    "Run",
    "TemplateFlowSpec",
    "TemplateParameter",
    "TemplateRef",
    "TemplateStatus",
    "TokenUsage",
    "Usage",
    "cel",
]
