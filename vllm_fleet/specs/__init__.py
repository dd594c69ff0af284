"""The spec: loading and the JSON Schema, semantic and hardware checks, the planner, the catalogues, where a spec comes
from."""
