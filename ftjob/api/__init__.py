"""The resource, declared once: schema, spec, status, CRD, kube validation, admission rules,
manifests, the trainer <-> operator contract and GPU hardware. Imports no other ftjob layer."""
