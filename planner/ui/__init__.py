"""The Streamlit dashboard and its plotly figures."""
