"""flowkube API: the Flow resource models and the names shared by operator and runner."""
