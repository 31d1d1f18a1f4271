"""Flask only: the API blueprints, the relay that streams answers, error rendering."""
