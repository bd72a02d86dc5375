from stg.cli import app

app(prog_name="stg")
