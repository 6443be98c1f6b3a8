"""FlowTemplates and ClusterFlowTemplates: the template cache (`cache`) and the snapshots Flows take
(`snapshots`)."""
