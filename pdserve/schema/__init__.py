"""``pdserve schema``: JSON Schema for every wire type, for mirrors of the protocol in other languages
(the RFC's section 10). The checked-in copy under docs/schema/ is compared with a fresh export by a unit
test, so a change to a wire type that forgets the schema fails CI."""

from pdserve.schema.export import add_schema_args, render_schemas, run_schema

__all__ = ["add_schema_args", "render_schemas", "run_schema"]
