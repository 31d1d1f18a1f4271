"""Flask only: the API blueprints, the request guards and body limit, error rendering."""
