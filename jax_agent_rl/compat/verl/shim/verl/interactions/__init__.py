"""verl's interaction base class under its module name."""
