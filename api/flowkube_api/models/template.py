"""FlowTemplates and ClusterFlowTemplates."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from flowkube_api.base import Model
from flowkube_api.constants import (
    TEMPLATE_PARAMETERS_LIMIT,
)
from flowkube_api.models.common import (
    AnyJson,
    FreeObject,
    ParameterType,
    cel,
)
from flowkube_api.models.spec import (
    FlowFields,
)

# ---------------------------------------------------------------------------------------- templates


class TemplateParameter(Model):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                      description="The input's key in spec.inputs (and in the flow's kickoff inputs).")
    description: str | None = Field(default=None, max_length=1024)
    required: bool | None = Field(default=None, description="A Flow must set it (unless it has a default).")
    default: AnyJson = Field(default=None, description="The value when a Flow does not set it.")
    type: ParameterType | None = Field(
        default=None, description="The JSON Schema type a value must have: string, integer, number, boolean, "
        "object or array.")


class TemplateFlowSpec(FlowFields):
    """A FlowTemplate's `spec.template`: a Flow's spec without `templateRef`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.definition) != has(self.flowRef)",
                    "exactly one of spec.template.definition or spec.template.flowRef must be set"),
            ]
        }
    )


class FlowTemplateSpec(Model):
    description: str | None = Field(default=None, max_length=4096)
    parameters: list[TemplateParameter] | None = Field(
        default=None, max_length=TEMPLATE_PARAMETERS_LIMIT,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="The inputs a Flow gives; when any are declared, a Flow's spec.inputs may hold only these.")
    template: TemplateFlowSpec = Field(description="The Flow spec every Flow of this template starts from.")


class FlowTemplate(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "FlowTemplate"
    metadata: FreeObject = Field(default_factory=dict)
    spec: FlowTemplateSpec


class ClusterFlowTemplate(FlowTemplate):
    kind: str = "ClusterFlowTemplate"
