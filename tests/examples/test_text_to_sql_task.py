"""The Text-to-SQL recipe's task and reward, with no server: the generated database and
questions, the held-out split, and execution-based scoring."""

from __future__ import annotations

import text_to_sql_rl as recipe


def test_split_is_disjoint_and_every_reference_returns_rows():
    conn = recipe.build_database(0)
    train, test = recipe.make_questions(conn, 0, 0.3)
    assert len(train) > 100 and len(test) > 40
    assert not {i["sql"] for i in train} & {i["sql"] for i in test}  # no held-out query is trained on
    for item in train + test:
        assert item["result"] and recipe.run_query(conn, item["sql"]) == item["result"]
    assert recipe.make_questions(recipe.build_database(0), 0, 0.3) == (train, test)  # deterministic


def test_reward_executes_the_query():
    conn = recipe.build_database(0)
    item = next(i for i in recipe.make_questions(conn, 0, 0.3)[1] if "COUNT(*)" in i["sql"])
    completion = item["sql"][len("SELECT"):]  # the prompt ends with "SELECT"
    assert recipe.reward(conn, item, completion) == (1.1, True)
    # Same result set written differently: still right (the reward compares results, not text).
    assert recipe.reward(conn, item, completion.replace("COUNT(*)", "count(1)"))[1]
    assert recipe.reward(conn, item, " COUNT(*) FROM employees;") == (0.1, False)  # runs, wrong rows
    assert recipe.reward(conn, item, " COUNT(*) FROM nowhere;") == (0.0, False)
    assert recipe.reward(conn, item, completion.rstrip(";")) == (1.0, True)  # no closing ';': no format bonus


def test_order_of_rows_does_not_matter_and_runaway_queries_stop():
    conn = recipe.build_database(0)
    item = {"result": recipe.run_query(conn, "SELECT name FROM employees WHERE age > 40;")}
    assert recipe.reward(conn, item, " name FROM employees WHERE age > 40 ORDER BY name DESC;")[1]
    runaway = " COUNT(*) FROM employees a, employees b, employees c, employees d, employees e;"
    assert recipe.run_query(conn, "SELECT" + runaway) is None
