from django.urls import path

from seedsite import views

urlpatterns = [
    path("healthz", views.healthz),
    path("work", views.work),
    path("slow-query", views.slow_query),
    path("deadline", views.deadline),
    path("hits", views.hits),
]
