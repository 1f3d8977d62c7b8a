"""The WSGI application: ``prazo serve seedsite.wsgi:application`` (run from examples/django_project)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "seedsite.settings")
application = get_wsgi_application()
