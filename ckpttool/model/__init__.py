"""The data model, the ground floor: records, the tree and its counting rule, dtypes, roles, units."""
